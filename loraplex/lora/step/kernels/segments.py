"""Grouped LoRA by segments: add each row's own adapter delta to a linear's output, and nothing else.

`add_lora`: for each segment of rows sharing an adapter, `out[rows] += scale * (x[rows] @ A.T) @ B.T`
("shrink" to rank r, then "expand"). A long prefill segment is one pair of matmuls (SGMV-like). Ranks may
differ between segments. Plain PyTorch (CPU and CUDA).

`add_lora_stacked` is the same delta for steps of many short segments (decode), in a fixed number of
calls per module whatever the number of adapters: each adapter's rows are gathered into a group of
their own (padded to the longest group with copies of the group's own first row), one batched matmul
shrinks every group with its own A, one expands it with its own B, and each row's result is picked
back out of its own group.

The isolation rule (docs/architecture.md): a row's output is computed from that row's input and its
own adapter's weights only. No kernel multiplies another adapter's values by a 0/1 mask (inf x 0 is
NaN): rows are selected by index, so a NaN or inf in one adapter, or in one row, never reaches another
adapter's rows or a base-model row, even when the weights were corrupted after the load-time checks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from loraplex.lora.step.row_maps import LoraGroups, LoraSegment
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
    out: torch.Tensor, x: torch.Tensor, groups: LoraGroups, a_stack: torch.Tensor, b_stack: torch.Tensor
) -> torch.Tensor:
    """out[rows] += delta of each row's own adapter; a_stack [G, R, in], b_stack [G, out, R] (scales
    folded in, ranks zero-padded to R), one entry per group of `groups`."""
    num_groups, rows_per_group = groups.num_groups, groups.rows_per_group
    grouped = x.index_select(0, groups.gather).view(num_groups, rows_per_group, -1)
    shrunk = torch.bmm(grouped, a_stack.transpose(1, 2))
    expanded = torch.bmm(shrunk, b_stack.transpose(1, 2)).view(num_groups * rows_per_group, -1)
    out[groups.start : groups.end] += expanded.index_select(0, groups.scatter)
    return out
