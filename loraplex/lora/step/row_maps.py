"""Which rows of a step use which adapter slot, in the forms the LoRA kernels take (lora/step/kernels/).

Plain data: the step's LoRA plan (plan.py) builds them, the kernels read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraSegment:
    """Rows `start:end` use the adapter in device slot `slot`."""

    slot: int
    start: int
    end: int


@dataclass
class LoraGroups:
    """Rows `start:end` (each using an adapter) laid out for the stacked LoRA form: one group per
    adapter of the stack, `rows_per_group` rows each. `gather` [groups * rows_per_group] names the row
    that fills each group position (positions no row of the group fills take row `start` and are never
    read back); `scatter` [end - start] names, for each row, its position in its own group."""

    start: int
    end: int
    num_groups: int
    rows_per_group: int
    gather: torch.Tensor
    scatter: torch.Tensor


@dataclass
class LoraTiles:
    """The tile form of per-row LoRA (lora/step/kernels/tiles.py): `table` [3, count] int32 on the device, each tile's
    first row, number of rows and slot."""

    table: torch.Tensor
    count: int


def lora_segments(slots: list[int | None], row_counts: list[int]) -> list[LoraSegment]:
    """Segments of consecutive rows sharing an adapter slot (base-model rows belong to none)."""
    segments: list[LoraSegment] = []
    start = 0
    for slot, count in zip(slots, row_counts):
        if slot is not None and count > 0:
            last = segments[-1] if segments else None
            if last is not None and last.slot == slot and last.end == start:
                segments[-1] = LoraSegment(slot, last.start, start + count)
            else:
                segments.append(LoraSegment(slot, start, start + count))
        start += count
    return segments
