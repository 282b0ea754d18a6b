"""The tile form's tiles (lora/step/kernels/tiles.py): every segment's rows in tiles of at most TILE_ROWS rows of its
slot, no tile across segments, and the rows of no segment in none. The Triton kernels that read them are checked
against the per-row reference on the GPU (tests/gpu/test_gpu_lora_tiles.py)."""

import torch

from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.step.kernels.tiles import TILE_ROWS, lora_tiles, reference_row_slots


def test_tiles_cover_each_segment_with_its_slot_and_nothing_else():
    segments = [LoraSegment(3, 0, 1), LoraSegment(0, 4, 4 + 2 * TILE_ROWS + 5), LoraSegment(7, 100, 100 + TILE_ROWS)]
    tiles = lora_tiles(segments, torch.device("cpu"))
    starts, counts, slots = tiles.table.tolist()
    assert tiles.table.dtype == torch.int32 and tiles.count == len(starts) == 1 + 3 + 1
    assert all(1 <= c <= TILE_ROWS for c in counts)
    assert list(zip(starts, counts, slots)) == [
        (0, 1, 3), (4, TILE_ROWS, 0), (4 + TILE_ROWS, TILE_ROWS, 0), (4 + 2 * TILE_ROWS, 5, 0), (100, TILE_ROWS, 7)]
    row_slots = reference_row_slots(tiles, 140)
    expected = [-1] * 140
    for s in segments:
        expected[s.start : s.end] = [s.slot] * (s.end - s.start)
    assert row_slots == expected


def test_no_segment_no_tile():
    tiles = lora_tiles([], torch.device("cpu"))
    assert tiles.count == 0 and tiles.table.shape == (3, 0)
    assert reference_row_slots(tiles, 3) == [-1, -1, -1]
