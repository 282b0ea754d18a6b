"""The tile form of per-row LoRA (SGMV): a step's rows cut into tiles of at most `TILE_ROWS` consecutive rows of one
adapter slot, each tile computed as one small matrix product against its slot's A and B.

Rows are ordered by adapter (the runner sorts them so), so each adapter's rows (a prompt's, several requests'
decode rows) form one segment, and a segment becomes one or more tiles. A tile reads its adapter's weights once
for all its rows, where the per-row form (`rows.py`, `bgmv.py`) reads them once per row: for a prompt of 500 rows,
500 times. The weights are found through the same `PointerTable` tables, so one launch serves any mix of adapters
and ranks. Rows in no tile (the base model's) are never written.

This module builds the tiles (CPU-importable); `sgmv.py` holds the Triton kernels (CUDA only). The reference is the
per-row one: `reference_row_slots` gives each row's slot for `rows.add_lora_rows_reference`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from loraplex.lora.step.row_maps import LoraSegment, LoraTiles

# Rows per tile: the M of each tile's tensor-core product. A decode row alone in its tile wastes most of it, but
# those products are tiny; a prompt's rows fill their tiles.
TILE_ROWS = 32


def lora_tiles(segments: Sequence[LoraSegment], device: torch.device) -> LoraTiles:
    """`segments` (disjoint, each of one slot) cut into tiles: one [3, N] int32 table (first row, row count, slot
    of each tile), copied to `device` in one go."""
    starts, counts, slots = [], [], []
    for segment in segments:
        for first in range(segment.start, segment.end, TILE_ROWS):
            starts.append(first)
            counts.append(min(TILE_ROWS, segment.end - first))
            slots.append(segment.slot)
    table = torch.tensor([starts, counts, slots], dtype=torch.int32)
    return LoraTiles(table.to(device), len(starts))


def reference_row_slots(tiles: LoraTiles, num_rows: int) -> list[int]:
    """Each row's slot as `tiles` assign it (-1: in no tile)."""
    slots = [-1] * num_rows
    starts, counts, tile_slots = tiles.table.tolist()
    for start, count, slot in zip(starts, counts, tile_slots):
        assert all(s == -1 for s in slots[start : start + count]), "tiles overlap"
        slots[start : start + count] = [slot] * count
    return slots
