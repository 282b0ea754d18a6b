"""Grouped LoRA: add each row group's adapter delta to a linear's output.

`add_lora` is the interface every implementation provides: for each segment of rows sharing an
adapter, `out[rows] += scale * (x[rows] @ A.T) @ B.T` ("shrink" to rank r, then "expand"). A long
prefill segment is one pair of matmuls (SGMV-like); a decode segment is a few rows (BGMV-like).
Ranks may differ between segments. This is the plain PyTorch implementation (CPU and CUDA); faster
GPU kernels plug in behind the same signature.

`add_lora_stacked` is the same delta for steps of many short segments (decode): every active
adapter's A stacked into one matrix, so the whole step is two matmuls per module whatever the number
of adapters; a 0/1 mask keeps, for each row, only its own adapter's rank columns. It computes every
adapter's shrink for every row, which is cheap only while rows are few (the runner decides).
"""

from __future__ import annotations

from typing import Sequence

import torch

from loraplex.layers.forward_context import LoraSegment
from loraplex.lora.adapter import LoraWeights


def add_lora(
    out: torch.Tensor, x: torch.Tensor, segments: Sequence[LoraSegment], slots: Sequence[LoraWeights | None]
) -> torch.Tensor:
    """Add, in place, the LoRA delta of each segment's adapter to `out` [rows, out_features]."""
    for segment in segments:
        weights = slots[segment.slot]
        if weights is None:  # the adapter in this slot does not target this module
            continue
        rows = slice(segment.start, segment.end)
        shrunk = x[rows] @ weights.a.t()
        out[rows].addmm_(shrunk, weights.b.t(), alpha=weights.scale)
    return out


def add_lora_stacked(
    out: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor
) -> torch.Tensor:
    """out += ((x @ a_stack.T) * mask) @ b_stack.T; a_stack [W, in], b_stack [out, W] (scales folded in)."""
    shrunk = (x @ a_stack.t()).mul_(mask)
    return out.addmm_(shrunk, b_stack.t())
