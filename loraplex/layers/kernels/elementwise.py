"""Fused elementwise kernels for CUDA: each does in one launch what its torch reference does in several, with the
same rounding steps (values are rounded to the tensor's dtype wherever the reference rounds them), so a decode
step launches a few kernels per layer instead of dozens. Layers take them while a CUDA graph is captured and, launched
directly (launch.py), in eager steps too (`fused_kernels_wanted`). The references: `RMSNorm.forward` and
`RMSNorm.add_and_norm` (layers/norms.py),
`apply_rotary` (layers/rotary.py), `silu(gate) * up` (layers/activation.py); tests/gpu/test_gpu_elementwise.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from loraplex.kernels.launch import Launcher


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, size, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    x32 = x.to(tl.float32)
    normed = (x32 * libdevice.rsqrt(tl.sum(x32 * x32, axis=0) / size + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), statistics in float32, over the last dimension; weight in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    assert rows.stride(-1) == 1 and weight.dtype == x.dtype
    out = torch.empty_like(rows)
    _rms_norm[(rows.shape[0],)](rows, weight, out, rows.shape[1], eps, rows.stride(0), out.stride(0),
                                BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr, size, eps, stride_x, stride_r,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    residual = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
    summed = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # rounded as `residual + x` rounds
    tl.store(sum_ptr + row * size + cols, summed, mask=ok)
    s32 = summed.to(tl.float32)
    normed = (s32 * libdevice.rsqrt(tl.sum(s32 * s32, axis=0) / size + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * size + cols, (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x and residual [T, size] of one dtype, in one pass."""
    assert x.dim() == residual.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype
    assert x.stride(1) == residual.stride(1) == 1
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _add_rms_norm[(x.shape[0],)](x, residual, weight, summed, out, x.shape[1], eps, x.stride(0),
                                 residual.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]))
    return out, summed


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, size, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(gate_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + libdevice.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * size + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, for gate and up [T, F] of one dtype with the same row stride and dense rows (such as
    the two halves of a fused gate/up product) -> a new contiguous [T, F]."""
    assert gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
    assert gate.stride(1) == up.stride(1) == 1 and gate.stride(0) == up.stride(0)
    rows, size = gate.shape
    out = torch.empty(rows, size, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_and_mul[(rows, triton.cdiv(size, block))](gate, up, out, size, gate.stride(0), BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ct,
                   HALF: tl.constexpr, HALF_P: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF_P)
    ok = dims < HALF
    base = x_ptr + row * stride_xt + head * stride_xh
    first = tl.load(base + dims, mask=ok, other=0.0)
    second = tl.load(base + HALF + dims, mask=ok, other=0.0)
    # cos and sin repeat over the two halves (emb = cat(freqs, freqs)).
    cos = tl.load(cos_ptr + row * stride_ct + dims, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_ct + dims, mask=ok, other=0.0).to(tl.float32)
    dtype = first.dtype
    f, s = first.to(tl.float32), second.to(tl.float32)
    # rotate_half(x) = cat(-second, first): each product rounded, then the sum, as the reference rounds them.
    out_first = ((f * cos).to(dtype).to(tl.float32) + (-s * sin).to(dtype).to(tl.float32)).to(dtype)
    out_second = ((s * cos).to(dtype).to(tl.float32) + (f * sin).to(dtype).to(tl.float32)).to(dtype)
    out = out_ptr + (row * heads + head) * (2 * HALF)
    tl.store(out + dims, out_first, mask=ok)
    tl.store(out + HALF + dims, out_second, mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D] (rotate-half layout) into a new contiguous tensor."""
    rows, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride() and dim % 2 == 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = dim // 2
    _rotary[(rows, heads)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                           HALF=half, HALF_P=triton.next_power_of_2(half))
    return out


# Eager steps launch these for every layer: launched directly (launch.py says why).
_rms_norm = Launcher(_rms_norm_kernel)
_add_rms_norm = Launcher(_add_rms_norm_kernel)
_silu_and_mul = Launcher(_silu_and_mul_kernel)
_rotary = Launcher(_rotary_kernel)
