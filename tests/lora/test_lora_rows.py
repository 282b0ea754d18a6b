"""The per-row LoRA form on the CPU: its torch reference against the segment form, and the slot tables it reads
(the Triton kernel itself is compared with the reference in tests/gpu/test_gpu_lora_rows.py)."""

import torch

from loraplex.layers.forward_context import LoraSegment
from loraplex.lora.adapter import LoraWeights
from loraplex.lora.upload import laid_out
from loraplex.lora.kernels import SlotPointers, add_lora, add_lora_rows_reference


def weights(rank, seed, in_features=24, out_features=10):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rank, in_features, generator=g), torch.randn(out_features, rank, generator=g)
    return laid_out(LoraWeights(a, b, 0.5))


def test_reference_matches_the_segment_form():
    slots = [weights(4, 0), weights(8, 1), None]
    row_slots = [0, 0, 1, -1, 2, 1]
    x, base = torch.randn(6, 24), torch.randn(6, 10)
    expected = add_lora(base.clone(), x, [LoraSegment(0, 0, 2), LoraSegment(1, 2, 3), LoraSegment(1, 5, 6)], slots)
    got = add_lora_rows_reference(base.clone(), x, row_slots, slots)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[3:5], base[3:5])


def test_slot_tables_follow_installs():
    tables = SlotPointers(["q", "v"], 3, torch.device("cpu"))
    assert tables.targeted == frozenset()
    q = weights(4, 0)
    tables.set_slot(1, {"q": q, "v": None})
    pointers, ranks, scales = tables.layer("q")
    assert pointers[1].tolist() == [q.a.data_ptr(), q.b.t().data_ptr()]
    assert ranks.tolist() == [0, 4, 0] and scales[1].item() == 0.5
    assert tables.layer("v")[1].tolist() == [0, 0, 0]
    assert tables.targeted == frozenset({"q"})
    tables.set_slot(1, {"v": weights(8, 1)})  # a new adapter replaces the slot's entries, all of them
    assert tables.layer("q")[1].tolist() == [0, 0, 0] and tables.layer("v")[1].tolist() == [0, 8, 0]
    assert tables.targeted == frozenset({"v"})
