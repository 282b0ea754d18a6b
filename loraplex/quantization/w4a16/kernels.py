"""The W4A16 dequantize-GEMM in Triton: out [M, N] = x [M, K] @ w.T (+ bias), w dequantized from the packed form of
`w4a16` (blocks of 128 input features, nibble j of 16 consecutive words = 16 consecutive features) as it is read.

One program per (block of rows, block of output columns, split of the input features). Per 128-feature block it
loads 16 words x BLOCK_N columns once, dequantizes all eight nibbles of them into a [128, BLOCK_N] tile in feature
order (a shift, a mask, an or that makes the float 2^23 + q, minus 2^23 + zero, times scale: exact in float32, then
rounded to x's dtype as the reference's cast rounds) and multiplies it by x's 128 matching columns on the tensor
cores, one dot per block.

Up to `w4a16_rows.MAX_ROWS` rows (decode with few requests) take w4a16_rows' CUDA-core kernel instead. For more
rows of decode the input features are still split across programs (split_k) to keep every SM streaming weights;
prefill-sized products get enough programs from their tiles: one split, no partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.quantization.w4a16 import rows as w4a16_rows
from loraplex.quantization.split_k import SplitLaunch, finish_tile, split_plan

PACK_BLOCK = 128  # input features per packed block (w4a16.KERNEL_BLOCK)
# Launch shapes, from the sweep of benchmarks/w4a16_kernels.py on an H200 (each M range its best):
PROGRAMS_PER_SM = 8  # programs wanted for a decode-sized product: several per SM keep enough loads in flight
# (most rows, BLOCK_M, BLOCK_N, num_warps): the first entry whose most rows is >= M (None: any); tl.dot needs 16 rows.
TILES = [(16, 16, 128, 4), (32, 32, 128, 4), (64, 64, 64, 4), (None, 64, 128, 8)]
PARTIAL_SHARE = 1.0  # the float32 partials' traffic allowed, as a share of the weight's bytes
# How a split product's partials are added: "in-kernel" (the last split of each tile adds them) or "kernel" (a
# second launch: split_k.sum_splits).
SPLIT_REDUCE = "kernel"


def tile_config(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a product of m rows."""
    return next((bm, bn, warps) for most, bm, bn, warps in TILES if most is None or m <= most)


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
    finish_tile(acc, bias_ptr, out_ptr, partial_ptr, counters_ptr, rows, cols, M, N, stride_out,
                tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), HAS_BIAS=HAS_BIAS, PARTIAL=PARTIAL,
                REDUCE_HERE=REDUCE_HERE)


_matmul = Launcher(_w4a16_kernel)


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
    if m <= w4a16_rows.MAX_ROWS:
        return w4a16_rows.matmul(x, qweight, scales, zeros, group_size, bias, counters, perm)
    n = qweight.shape[1]
    block_m, block_n, warps = tile_config(m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    blocks = k // PACK_BLOCK
    # The partials (written and read: 8 bytes per split, row and column) within PARTIAL_SHARE of the weight's
    # bytes (64 per column and block).
    most_splits = max(1, int(8 * PARTIAL_SHARE * blocks / m))
    splits, per_split = split_plan(tiles, blocks, most_splits, PROGRAMS_PER_SM, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = SplitLaunch(m, n, splits, tiles, out, counters, SPLIT_REDUCE == "in-kernel")
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    _matmul[grid](x, perm if perm is not None else qweight, qweight, scales, zeros,
                  bias if bias is not None else scales, out, launch.partial, launch.counters, m, n, x.stride(0),
                  out.stride(0), per_split, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n,
                  HAS_PERM=perm is not None, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
                  REDUCE_HERE=launch.reduce_here, num_warps=warps)
    return launch.finish(bias)
