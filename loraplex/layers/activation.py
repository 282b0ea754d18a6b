"""Gated activations of feed-forward layers: act(gate) * up, fused into one kernel for SiLU in CUDA graphs."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from loraplex.layers.kernels import fused_kernels_wanted


def act_and_mul(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if (act is F.silu and fused_kernels_wanted(gate.device) and gate.dim() == 2 and gate.stride(1) == up.stride(1) == 1
            and gate.stride(0) == up.stride(0)):
        from loraplex.layers.kernels.elementwise import silu_and_mul

        return silu_and_mul(gate, up)
    return act(gate) * up
