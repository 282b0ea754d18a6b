"""Per-token FP8 activation quantization in one Triton launch: for each row, its absmax, its scale (absmax / 448,
or the static scale) and the e4m3 row, where the torch ops (fp8/numerics.py quantize_rows_torch, the reference, with
the same divisions and roundings) take four launches. Every FP8 linear of a decode step runs it once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.quantization.fp8.numerics import FP8_MAX, MIN_SCALE


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, count, size, stride_x, min_scale, fp8_max,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    live = row < count  # rows past `count` pad the output: zeros
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=(cols < size) & live, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, size, BLOCK):  # the row again, from L2: quantize with the scale
        cols = start + tl.arange(0, BLOCK)
        ok = cols < size
        x = tl.load(x_row + cols, mask=ok & live, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * size + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


_quantize_rows = Launcher(_quantize_rows_kernel)
BLOCK = 1024


def quantize_rows(rows: torch.Tensor, static_scale: torch.Tensor | None,
                  min_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] (last dimension dense) -> (e4m3 rows [P, K] contiguous, float32 scales [P, 1]), P = max(M,
    min_rows): rows past M are zeros (a product of a few rows may take a faster kernel with more)."""
    assert rows.dim() == 2 and rows.stride(1) == 1
    count, size = rows.shape
    padded = max(count, min_rows)
    q = torch.empty(padded, size, dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty(padded, 1, dtype=torch.float32, device=rows.device)
    static = static_scale is not None
    _quantize_rows[(padded,)](rows, q, scale, static_scale if static else scale, count, size, rows.stride(0),
                              MIN_SCALE, FP8_MAX, STATIC=static, BLOCK=BLOCK)
    return q, scale
