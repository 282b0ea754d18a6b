"""The FP8 weight's product for few rows (decode), in Triton: out [M, N] = x [M, K] @ (w [N, K] * scale[N]).T + bias,
the e4m3 weight widened to x's dtype as it is read (weight-only: x is not quantized).

cuBLASLt's FP8 `_scaled_mm` reads a decode step's weight at a fraction of the memory bandwidth (benchmarks/fp8_kernels
measures it), and quantizing the activations first is one more launch per linear; a decode step is all weight reads.
So for up to `fp8_layers.WEIGHT_ONLY_MAX_ROWS` rows (and input widths in blocks of 128) the layer takes this kernel: one program per (block of output columns, split of the input
features), each split writing its float32 partial, added in split order by a second launch (the same sum every run),
as the W4A16 kernel does. Shapes and splits depend only on M, N, K: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.quantization.w4a16_triton import split_plan, sum_splits

BLOCK_K = 128
BLOCK_N = 64


@triton.jit
def _fp8_weight_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K, stride_x, stride_out,
                       blocks_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, blocks_per_split):
        ks = (split * blocks_per_split + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None], other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        tl.store(partial_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


_matmul = Launcher(_fp8_weight_kernel)


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (bfloat16/float16, M <= 16) @ (weight [N, K] e4m3 * scale [N] float32).T + bias -> x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    blocks = k // BLOCK_K
    # The W4A16 plan counts a block's weight bytes at 4 bits: twice that here, so twice its partials' share.
    splits, per_split = split_plan(triton.cdiv(n, BLOCK_N), blocks, max(1, m // 2), x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    _matmul[(triton.cdiv(n, BLOCK_N), splits)](
        x, weight, scale, bias if bias is not None else scale, out, partial, m, n, k, x.stride(0), out.stride(0),
        per_split, BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
        num_warps=4)
    if splits > 1:
        sum_splits(partial, bias, out)
    return out
