"""The weight-only product of few rows (decode) in Triton: out [M, N] = x [M, K] @ (w [N, K] * scale[N]).T + bias,
the 8-bit weight widened as it is read (x is not quantized): FP8 e4m3 (fp8/layers.py) or int8 (bnb/layers.py:
bitsandbytes' 8-bit weights), one float32 scale per output channel.

cuBLASLt's FP8 `_scaled_mm` reads a decode step's weight at a fraction of the memory bandwidth (benchmarks/fp8_kernels
measures it), and quantizing the activations first is one more launch per linear; a decode step is all weight reads.
So for few rows (and input widths in blocks of BLOCK_K) the layers take one of two kernels, per row count (CONFIGS,
from the sweep of `python -m benchmarks.quantized_rows` on an H200):

- "rows": on the CUDA cores, one row per program (the programs of a tile's rows run side by side and share its
  reads), a float32 accumulator per (column, input feature of the block) that x times the widened weight is added
  to, summed once at the end: no tensor-core tile for 15 unused rows, no shared memory;
- "dot": the widened weight tile times BLOCK_M of x's rows (padded to 16) on the tensor cores; more rows than
  BLOCK_M take more row blocks (the grid's first axis).

Both split the input features across programs (split_k) so that every SM streams weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.quantization.split_k import SplitLaunch, finish_tile, split_plan

BLOCK_K = 128
# (most rows, kernel, BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM, partial share): the first entry whose
# most rows is >= M. The partial share bounds the float32 partials' traffic as a share of the weight's bytes.
CONFIGS = [(1, "rows", 1, 64, 4, 2, 4, 1.0), (8, "dot", 16, 64, 4, 3, 8, 1.0), (16, "dot", 16, 32, 4, 3, 8, 1.0),
           (32, "dot", 32, 128, 8, 3, 2, 1.0), (64, "dot", 64, 128, 4, 3, 2, 1.0)]
IN_KERNEL_REDUCE = False  # the last split adds the partials (split_k's "in-kernel"), else a second launch


def max_rows() -> int:
    """The most rows the kernels take; products of more take the layer's other path."""
    return CONFIGS[-1][0]


def config(m: int) -> tuple[str, int, int, int, int, int, float]:
    """(kernel, BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM, partial share) for m rows."""
    return next(entry[1:] for entry in CONFIGS if m <= entry[0])


@triton.jit
def _dot_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr, M, N, K, stride_x,
                stride_out, blocks_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, REDUCE_HERE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, blocks_per_split):
        block = tl.program_id(2) * blocks_per_split + step
        ks = block * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=col_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += tl.dot(x, w.to(x.dtype))
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    finish_tile(acc, bias_ptr, out_ptr, partial_ptr, counters_ptr, rows, cols, M, N, stride_out, tile,
                HAS_BIAS=HAS_BIAS, PARTIAL=PARTIAL, REDUCE_HERE=REDUCE_HERE)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr, M, N, K, stride_x,
                 stride_out, blocks_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, REDUCE_HERE: tl.constexpr):
    row = tl.program_id(0)  # one row per program (BLOCK_M is 1): a tile's rows run together and share its reads
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in range(0, blocks_per_split):
        block = tl.program_id(2) * blocks_per_split + step
        ks = block * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=col_ok[:, None], other=0.0,
                    eviction_policy="evict_first")
        acc += x[None, :] * w.to(tl.float16).to(tl.float32)  # e4m3 and int8 widen exactly to float16
    out = tl.sum(acc, axis=1) * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
    finish_tile(out[None, :], bias_ptr, out_ptr, partial_ptr, counters_ptr, row + tl.arange(0, 1), cols, M, N,
                stride_out, tl.program_id(1) * M + row, HAS_BIAS=HAS_BIAS, PARTIAL=PARTIAL, REDUCE_HERE=REDUCE_HERE)


_kernels = {"dot": Launcher(_dot_kernel), "rows": Launcher(_rows_kernel)}


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16/float16, M <= MAX_ROWS, K a multiple of BLOCK_K) @ (weight [N, K] e4m3 or int8 * scale [N]
    float32).T + bias -> x's dtype. `counters` (split_k.split_counters) lets a split product add its partials
    in-kernel."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    kernel, block_m, block_n, warps, stages, programs_per_sm, share = config(m)
    row_programs = m if kernel == "rows" else triton.cdiv(m, block_m)
    tiles = row_programs * triton.cdiv(n, block_n)
    blocks = k // BLOCK_K
    # The partials (written and read: 8 bytes per split, row and column) within `share` of the weight's bytes (one
    # byte per weight: BLOCK_K per column and block).
    splits, per_split = split_plan(tiles, blocks, max(1, int(share * k / (8 * m))), programs_per_sm, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = SplitLaunch(m, n, splits, tiles, out, counters, IN_KERNEL_REDUCE)
    _kernels[kernel][(row_programs, triton.cdiv(n, block_n), splits)](
        x, weight, scale, bias if bias is not None else scale, out, launch.partial, launch.counters, m, n, k,
        x.stride(0), out.stride(0), per_split, BLOCK_M=max(block_m, 16) if kernel == "dot" else 1, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None, PARTIAL=splits > 1, REDUCE_HERE=launch.reduce_here,
        num_warps=warps, num_stages=stages)
    return launch.finish(bias)

