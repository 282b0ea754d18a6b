"""Normalisation layers."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.layers.kernels import fused_kernels_wanted


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight; with `offset` (Gemma's 1) the scale is offset + weight, taken in float32
    and applied before the cast to x's dtype, as Gemma computes it (the fused kernels do not take an offset)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        if fused_kernels_wanted(x.device) and x.dtype == self.weight.dtype and x.stride(-1) == 1:
            from loraplex.layers.kernels.elementwise import rms_norm

            return rms_norm(x, self.weight, self.eps)  # in a CUDA graph: one kernel, the same rounding as below
        # Statistics in float32 whatever the model dtype; scale applied in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x): in a CUDA graph one kernel instead of two."""
        if (not self.offset and fused_kernels_wanted(x.device) and x.dim() == 2 and x.shape == residual.shape
                and x.dtype == residual.dtype == self.weight.dtype and x.stride(-1) == residual.stride(-1) == 1):
            from loraplex.layers.kernels.elementwise import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self.forward(summed), summed
