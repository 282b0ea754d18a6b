"""The W4A16 dequantize-GEMM in Triton: out [M, N] = x [M, K] @ w.T (+ bias), w dequantized from the packed form of
`w4a16` (blocks of 128 input features, nibble j of 16 consecutive words = 16 consecutive features) as it is read.

One program per (block of rows, block of output columns, split of the input features). Per 128-feature block it
loads 16 words x BLOCK_N columns once, dequantizes all eight nibbles of them into a [128, BLOCK_N] tile in feature
order (a shift, a mask, an or that makes the float 2^23 + q, minus 2^23 + zero, times scale: exact in float32, then
rounded to x's dtype as the reference's cast rounds) and multiplies it by x's 128 matching columns on the tensor
cores, one dot per block.

Few rows (decode) read the weight once and do little arithmetic, so the input features are split across programs to
keep every SM streaming weights; each split writes its own float32 partial, and the partials are added in a fixed
order (the same result every run), with the bias, then cast: by the tile's last split to finish, counted with an
atomic (SPLIT_REDUCE "in-kernel"), or by a second kernel. Many rows (prefill) get enough programs from their
tiles: one split, no partials. Shapes and splits depend only on M, N, K: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher

PACK_BLOCK = 128  # input features per packed block (w4a16.KERNEL_BLOCK)
WORDS = PACK_BLOCK // 8
REDUCE_BLOCK = 256
# Launch shapes, from the sweep of benchmarks/w4a16_kernels.py on an H200 (each M range its best):
PROGRAMS_PER_SM = 8  # programs wanted for a decode-sized product: several per SM keep enough loads in flight
# (most rows, BLOCK_M, BLOCK_N, num_warps): the first entry whose most rows is >= M (None: any); tl.dot needs 16 rows.
TILES = [(16, 16, 128, 4), (32, 32, 128, 4), (64, 64, 64, 4), (None, 64, 128, 8)]
PARTIAL_SHARE = 1.0  # the float32 partials' traffic allowed, as a share of the weight's bytes
# How a split product's partials are added: "in-kernel" (the last split of each tile adds them) or "kernel" (a
# second launch, _sum_splits_kernel).
SPLIT_REDUCE = "kernel"
COUNTERS = 4096  # output tiles a layer's counters cover; a product with more (never split in practice) takes "kernel"


def tile_config(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a product of m rows."""
    return next((bm, bn, warps) for most, bm, bn, warps in TILES if most is None or m <= most)


@triton.jit
def _finish(acc, bias_ptr, out_ptr, rows, cols, ok, col_ok, stride_out, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w4a16_kernel(x_ptr, perm_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr,
                  M, N, stride_x, stride_out, blocks_per_split,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, REDUCE_HERE: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok = rows < M
    col_ok = cols < N
    words = tl.arange(0, 16)
    nibbles = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, blocks_per_split):
        block = split * blocks_per_split + step
        packed = tl.load(qweight_ptr + (block * 16 + words)[:, None] * N + cols[None, :], mask=col_ok[None, :],
                         other=0)
        # Nibble j of word r is the block's feature 16 j + r: [8, 16, BLOCK_N] in feature order, one dot of 128.
        groups = (block * 128 + nibbles * 16) // GROUP  # 16 features never straddle a group
        scale = tl.load(scales_ptr + groups[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0.0)
        zero = tl.load(zeros_ptr + groups[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0.0)
        # 0x4B000000 is 2^23 as a float32: or-ing q into its mantissa gives 2^23 + q without a conversion.
        q = ((packed[None, :, :] >> (4 * nibbles)[:, None, None]) & 0xF) | 0x4B000000
        w = ((q.to(tl.float32, bitcast=True) - (zero.to(tl.float32) + 8388608.0)[:, None, :])
             * scale.to(tl.float32)[:, None, :])
        features = block * 128 + tl.arange(0, 128)
        if HAS_PERM:  # act-order: the kernel's feature i is x's column perm[i]
            features = tl.load(perm_ptr + features)
        x = tl.load(x_ptr + rows[:, None] * stride_x + features[None, :], mask=row_ok[:, None], other=0.0)
        acc += tl.dot(x, tl.reshape(w, (128, BLOCK_N)).to(x.dtype))
    ok = row_ok[:, None] & col_ok[None, :]
    if not PARTIAL:
        _finish(acc, bias_ptr, out_ptr, rows, cols, ok, col_ok, stride_out, HAS_BIAS)
    else:  # float32 partial [splits, M, N]
        partial_at = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(partial_at + split * M * N, acc, mask=ok)
        if REDUCE_HERE:
            # The tile's last split to arrive adds all the partials, in split order (the same sum every run), and
            # resets the tile's counter for the next call. The barrier puts every thread's store before the
            # release of the counter's increment; the second, every thread's loads after its acquire.
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for other in range(0, tl.num_programs(2)):
                    total += tl.load(partial_at + other * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                _finish(total, bias_ptr, out_ptr, rows, cols, ok, col_ok, stride_out, HAS_BIAS)
                tl.atomic_xchg(counters_ptr + tile, 0)


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_out,
                       SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + (split * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


_matmul = Launcher(_w4a16_kernel)
_sum_splits = Launcher(_sum_splits_kernel)


@functools.cache
def _sm_count(device_index: int) -> int:
    if not torch.cuda.is_available():  # TRITON_INTERPRET=1 on the CPU: any figure does
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(tiles: int, blocks: int, m: int, device: torch.device) -> tuple[int, int]:
    """(splits, blocks per split) of `blocks` input blocks so that tiles x splits fills the GPU: the most splits,
    up to that, that divide the blocks evenly (no split runs short, so the kernel needs no bound of its own).
    The float32 partials (written and read: 8 bytes per split, row and column) stay within PARTIAL_SHARE of the
    weight's bytes (64 per column and block): at most 8 * PARTIAL_SHARE * blocks / m splits."""
    wanted = _sm_count(device.index or 0) * PROGRAMS_PER_SM // tiles
    wanted = max(1, min(blocks, wanted, int(8 * PARTIAL_SHARE * blocks / m)))
    splits = max(d for d in range(1, wanted + 1) if blocks % d == 0)
    return splits, blocks // splits


def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
           bias: torch.Tensor | None, counters: torch.Tensor | None = None,
           perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float16/bfloat16) @ the dequantized weight.T + bias -> [M, N] in x's dtype; with `perm` (int32
    [K], act-order), the weight's input feature i multiplies x's column perm[i] (x is read through it).

    `counters` (int32 zeros, one per output tile: `split_counters`) lets a split product add its partials in the
    same kernel (SPLIT_REDUCE "in-kernel"); calls that share them must run one after another (one stream)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, warps = tile_config(m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    blocks = k // PACK_BLOCK
    splits, per_split = split_plan(tiles, blocks, m, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else scales  # never read without a bias
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    reduce_here = (splits > 1 and SPLIT_REDUCE == "in-kernel" and counters is not None
                   and counters.numel() >= tiles)
    _matmul[grid](x, perm if perm is not None else qweight, qweight, scales, zeros, bias_arg, out, partial,
                  counters if reduce_here else qweight, m, n, x.stride(0), out.stride(0), per_split,
                  GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, HAS_PERM=perm is not None, HAS_BIAS=has_bias,
                  PARTIAL=splits > 1, REDUCE_HERE=reduce_here, num_warps=warps)
    if splits > 1 and not reduce_here:
        _sum_splits[(m, triton.cdiv(n, REDUCE_BLOCK))](partial, bias_arg, out, m, n, out.stride(0), SPLITS=splits,
                                                      BLOCK=REDUCE_BLOCK, HAS_BIAS=has_bias, num_warps=4)
    return out


def sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the float32 partials [splits, M, N] added in split order (+ bias), in out's dtype."""
    splits, m, n = partial.shape
    has_bias = bias is not None
    _sum_splits[(m, triton.cdiv(n, REDUCE_BLOCK))](partial, bias if has_bias else partial, out, m, n, out.stride(0),
                                                  SPLITS=splits, BLOCK=REDUCE_BLOCK, HAS_BIAS=has_bias, num_warps=4)


def split_counters(device: torch.device) -> torch.Tensor:
    """The tile counters a layer passes to `matmul` (enough for any split product: splits need few rows)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)
