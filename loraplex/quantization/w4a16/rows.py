"""The W4A16 product of a few rows (decode) in Triton, on the CUDA cores: out [M, N] = x [M, K] @ w.T (+ bias), w
read in `w4a16`'s packed form (blocks of 128 input features, nibble j of 16 consecutive words = 16 consecutive
features) and never formed as a tile of floats.

A decode step's product is all weight reads, and for one row a tensor-core dot wastes 15 of its 16 rows and its
dequantized tile's round trip through shared memory. Here each program takes one row and one block of output
columns, keeps a float32 accumulator per (word, column) and adds x times the weight's nibbles straight from
registers; the programs of one tile's rows run side by side, so its weight is read from HBM about once. The nibble is turned into a float without a
conversion instruction: for nibble j < 5 of a word, (word & 0xF << 4j) | 0x4B000000 is the float 2^23 + q 16^j
(2^23's mantissa has room for it), so one subtraction gives (q - zero) 16^j exactly, and x's column is scaled by
16^-j to match; nibbles 5-7 come the same way from the word shifted right by 20. That is one integer operation, one
subtraction and one multiply-add per weight, where unpacking and converting took several more. Groups of 128 apply
their scale once per block.

The input features are split across programs (split_k) so that every SM streams weights; the launch shape for each
row count comes from the sweep of `python -m benchmarks.quantized_rows` on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.quantization.split_k import SplitLaunch, finish_tile, split_plan

PACK_BLOCK = 128  # input features per packed block (w4a16.KERNEL_BLOCK)
# (most rows, BLOCK_N, num_warps, num_stages, programs per SM, partial share): the first entry whose most rows is
# >= M. The partial share bounds the float32 partials' traffic as a share of the weight's bytes.
# Two rows already take longer here than on the tensor cores (each row's program unpacks the weight again).
CONFIGS = [(1, 64, 4, 2, 16, 1.0)]
MAX_ROWS = CONFIGS[-1][0]  # more rows take w4a16_triton's tensor-core kernel
IN_KERNEL_REDUCE = False
# 0x4B000000 is 2^23 as a float32. Passed as an argument, it sits in a register: the mask and the or then make one
# LOP3 instruction (it takes one immediate operand; two constants made it two).
MAGIC = 0x4B000000  # the last split adds the partials (split_k's "in-kernel"), else a second launch


def config(m: int) -> tuple[int, int, int, int, float]:
    """(BLOCK_N, num_warps, num_stages, programs per SM, partial share) for m rows (m <= MAX_ROWS)."""
    return next(entry[1:] for entry in CONFIGS if m <= entry[0])


@triton.jit
def _w4a16_rows_kernel(x_ptr, perm_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, partial_ptr,
                       counters_ptr, M, N, stride_x, stride_out, blocks_per_split, magic,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PARTIAL: tl.constexpr, REDUCE_HERE: tl.constexpr):
    row = tl.program_id(0)  # one row per program: the programs of a tile's rows run together and share its reads
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    words = tl.arange(0, 16)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for step in range(0, blocks_per_split):
        block = tl.program_id(2) * blocks_per_split + step
        packed = tl.load(qweight_ptr + (block * 16 + words)[:, None] * N + cols[None, :], mask=col_ok[None, :],
                         other=0, eviction_policy="evict_first")
        high = packed >> 20  # nibbles 5-7 at bits 0-11 (the sign bits above are masked off)
        block_acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        if GROUP >= 128:  # one group per block: its zero point loaded once
            block_zero = tl.load(zeros_ptr + block * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            shift = 4 * j if j < 5 else 4 * (j - 5)
            bits = ((packed if j < 5 else high) & (15 << shift)) | magic
            place = 1 << shift  # the float is 2^23 + q * place
            group = (block * 128 + 16 * j) // GROUP  # 16 features never straddle a group
            if GROUP >= 128:
                zero = block_zero
            else:
                zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = bits.to(tl.float32, bitcast=True) - (8388608.0 + zero * place)[None, :]  # (q - zero) * place
            features = block * 128 + 16 * j + words
            if HAS_PERM:  # act-order: the kernel's feature i is x's column perm[i]
                features = tl.load(perm_ptr + features)
            x = tl.load(x_ptr + row * stride_x + features).to(tl.float32) * (1.0 / place)
            if GROUP >= 128:
                block_acc += x[:, None] * w
            else:
                scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
                acc += x[:, None] * (w * scale[None, :])
        if GROUP >= 128:
            scale = tl.load(scales_ptr + block * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += block_acc * scale[None, :]
    rows = row + tl.arange(0, 1)
    finish_tile(tl.sum(acc, axis=0)[None, :], bias_ptr, out_ptr, partial_ptr, counters_ptr, rows, cols, M, N,
                stride_out, tl.program_id(1) * M + row, HAS_BIAS=HAS_BIAS, PARTIAL=PARTIAL, REDUCE_HERE=REDUCE_HERE)


_matmul = Launcher(_w4a16_rows_kernel)


def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
           bias: torch.Tensor | None, counters: torch.Tensor | None = None,
           perm: torch.Tensor | None = None) -> torch.Tensor:
    """w4a16_triton.matmul's product for M <= MAX_ROWS rows (x contiguous by rows)."""
    m, k = x.shape
    n = qweight.shape[1]
    block_n, warps, stages, programs_per_sm, share = config(m)
    tiles = triton.cdiv(n, block_n)
    blocks = k // PACK_BLOCK
    # The partials (written and read: 8 bytes per split, row and column) within `share` of the weight's bytes.
    splits, per_split = split_plan(m * tiles, blocks, max(1, int(8 * share * blocks / m)), programs_per_sm,
                                   x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = SplitLaunch(m, n, splits, m * tiles, out, counters, IN_KERNEL_REDUCE)
    _matmul[(m, tiles, splits)](
        x, perm if perm is not None else qweight, qweight, scales, zeros, bias if bias is not None else scales, out,
        launch.partial, launch.counters, m, n, x.stride(0), out.stride(0), per_split, MAGIC,
        GROUP=group_size, BLOCK_N=block_n, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        PARTIAL=splits > 1, REDUCE_HERE=launch.reduce_here, num_warps=warps, num_stages=stages)
    return launch.finish(bias)
