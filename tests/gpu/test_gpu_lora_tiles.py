"""The tile form's Triton kernels (lora/step/kernels/sgmv.py) against the per-row torch reference: segments long and
short (one row, a tile and a part, several tiles), rows of the base model between them, mixed ranks, a slot whose
adapter does not target the layer, sibling layers in one launch, and isolation (CUDA only)."""

import pytest
import torch

from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.step.kernels import add_lora_rows_reference
from loraplex.lora.step.kernels.tiles import TILE_ROWS, lora_tiles, reference_row_slots
from tests.gpu.test_gpu_lora_rows import sibling_tables, slot_weights, tables_for

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

from loraplex.lora.step.kernels.sgmv import add_lora_tiles_siblings  # noqa: E402  (Triton: CUDA only)

DEVICE = torch.device("cuda")
# (slot, rows) runs, base-model rows (slot None) between some: every slot of RANKS, the untargeting one included.
RUNS = [(0, 1), (None, 2), (1, TILE_ROWS + 3), (2, 3 * TILE_ROWS), (None, 1), (3, 5), (4, 7), (5, 200), (0, 1)]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def segments_of(runs) -> tuple[list[LoraSegment], int]:
    segments, row = [], 0
    for slot, rows in runs:
        if slot is not None:
            segments.append(LoraSegment(slot, row, row + rows))
        row += rows
    return segments, row


def as_float32(weights):
    return [None if w is None else w.to(DEVICE, torch.float32) for w in weights]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(4096, 1024), (576, 1536), (14336, 4096), (100, 37)])
def test_tiles_match_the_reference(dtype, shape):
    in_features, out_features = shape
    weights = slot_weights(in_features, out_features, dtype, seed=in_features)
    tables = tables_for(weights)
    segments, rows = segments_of(RUNS)
    tiles = lora_tiles(segments, DEVICE)
    row_slots = reference_row_slots(tiles, rows)
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    base = torch.randn(rows, out_features, device=DEVICE).to(dtype)
    expected = add_lora_rows_reference(base.float().clone(), x.float(), row_slots, as_float32(weights))
    got = base.clone()
    add_lora_tiles_siblings([got], x, tiles, tables, ["layer"], max_rank=64)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])
    untouched = [i for i, s in enumerate(row_slots) if s < 0 or weights[s] is None]
    assert torch.equal(got[untouched], base[untouched]), "rows without an adapter on this layer must not change"
    touched = [i for i in range(rows) if i not in untouched]
    assert not torch.equal(got[touched], base[touched]), "the adapters must change their rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_siblings_in_one_launch_equal_the_reference(dtype):
    """q/k/v-like siblings (one input, outputs side by side in one product), with mixed ranks and slots whose
    adapter targets only some of them."""
    in_features, widths, names, weights, tables = sibling_tables(dtype)
    segments, rows = segments_of([(0, 40), (None, 3), (1, 1), (2, 33), (3, 2)])
    tiles = lora_tiles(segments, DEVICE)
    row_slots = reference_row_slots(tiles, rows)
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    start = torch.randn(rows, sum(widths), device=DEVICE).to(dtype)
    fused = start.clone()
    add_lora_tiles_siblings(fused.split(widths, dim=-1), x, tiles, tables, names, max_rank=64)
    for name, got, before in zip(names, fused.split(widths, dim=-1), start.split(widths, dim=-1)):
        expected = add_lora_rows_reference(before.float().clone(), x.float(), row_slots, as_float32(weights[name]))
        torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])
    assert torch.equal(fused[40:43], start[40:43])  # the base model's rows


def test_a_corrupted_adapter_or_row_reaches_only_its_own_rows():
    weights = slot_weights(256, 128, torch.float32, seed=3, ranks=[8, 16])
    weights[1].a[0, 0] = float("nan")
    tables = tables_for(weights)
    segments, rows = segments_of([(0, TILE_ROWS + 4), (1, 3), (0, 2)])
    tiles = lora_tiles(segments, DEVICE)
    x = torch.randn(rows, 256, device=DEVICE)
    x[5, 7] = float("inf")  # one request's row in the first tile, beside rows of other requests on that adapter
    base = torch.randn(rows, 128, device=DEVICE)
    got = base.clone()
    add_lora_tiles_siblings([got], x, tiles, tables, ["layer"], max_rank=16)
    poisoned = {5} | set(range(TILE_ROWS + 4, TILE_ROWS + 7))
    clean = [i for i in range(rows) if i not in poisoned]
    assert torch.isfinite(got[clean]).all()
    assert not torch.isfinite(got[sorted(poisoned)]).all(dim=1).any()
    expected = add_lora_rows_reference(base.clone(), x, reference_row_slots(tiles, rows), [weights[0], None])
    torch.testing.assert_close(got[clean], expected[clean], atol=1e-4, rtol=1e-4)


def test_no_tiles_change_nothing():
    weights = slot_weights(64, 32, torch.float32, seed=4, ranks=[8])
    x, base = torch.randn(3, 64, device=DEVICE), torch.randn(3, 32, device=DEVICE)
    got = base.clone()
    add_lora_tiles_siblings([got], x, lora_tiles([], DEVICE), tables_for(weights), ["layer"], max_rank=8)
    assert torch.equal(got, base)
