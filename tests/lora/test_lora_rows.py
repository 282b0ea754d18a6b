"""The per-row LoRA form on the CPU: its torch reference against the segment form, and the slot tables it reads
(the Triton kernel itself is compared with the reference in tests/gpu/test_gpu_lora_rows.py)."""

import pytest
import torch

from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.adapter import LoraWeights
from loraplex.lora.device.upload import laid_out
from loraplex.lora.step.kernels import PointerTable, add_lora, add_lora_rows_reference
from loraplex.lora.step.kernels.rows import fits, sibling_launch, sibling_launch_at


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
    tables = PointerTable(["q", "v"], 3, torch.device("cpu"))
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


def test_a_sibling_launch_finds_the_outputs_columns_layers_and_splits():
    tables = PointerTable(["q", "k", "v", "o"], 2, torch.device("cpu"))
    fused = torch.zeros(5, 70 + 20 + 20)
    q, k, v = fused.split([70, 20, 20], dim=1)
    x = torch.zeros(5, 300)
    launch = sibling_launch([k, q, v], x, tables, ["k", "q", "v"], max_rank=17, units=5, block_n=64, block_k=64,
                            target_programs=20)
    assert launch.base == 1  # q: the one that starts first
    assert launch.offsets == (70, 0, 90) and launch.layers == (1, 0, 2) and launch.widths == (20, 70, 20)
    assert launch.blocks == (1, 2, 1) and launch.rank_p == 32
    assert (launch.splits, launch.per_split) == (3, 128)  # 20 programs / 5 rows -> 4 splits of 75, rounded to 128
    one = sibling_launch([fused[:, 100:]], x, tables, ["o"], max_rank=4, units=1000, block_n=64, block_k=64,
                         target_programs=20)
    assert one.offsets == (0, 0, 0) and one.layers == (3, 0, 0) and one.widths == (10, 0, 0) and one.blocks == (1, 0, 0)
    assert (one.rank_p, one.splits, one.per_split) == (16, 1, 320)


def test_a_launch_planned_before_its_outputs_exist_is_the_one_planned_from_them():
    """The shrink that runs beside the base product is planned from the product's columns; its expand then takes
    the product's slices: both plans must agree, targeted subsets of the siblings included."""
    tables = PointerTable(["q", "k", "v"], 2, torch.device("cpu"))
    fused = torch.zeros(5, 70 + 20 + 20)
    q, k, v = fused.split([70, 20, 20], dim=1)
    x = torch.zeros(5, 300)
    for outs, names, offsets in [([q, k, v], ["q", "k", "v"], [0, 70, 90]), ([k, v], ["k", "v"], [70, 90]),
                                 ([q, v], ["q", "v"], [0, 90]), ([v], ["v"], [90])]:
        planned = sibling_launch_at(offsets, [o.shape[1] for o in outs], x, tables, names, 17, 5, 64, 64, 20)
        assert planned == sibling_launch(outs, x, tables, names, 17, 5, 64, 64, 20)
        assert planned.count == len(outs) and fits(planned, outs)
    # The expand writes through the plan's offsets: any other outputs are refused.
    planned = sibling_launch_at([70, 90], [20, 20], x, tables, ["k", "v"], 17, 5, 64, 64, 20)
    assert not fits(planned, [v, k])  # out of order
    assert not fits(planned, [k])  # one missing
    assert not fits(planned, [k, torch.zeros(5, 20)])  # not a column of the same tensor
    assert not fits(planned, [q[:, :20], v])  # the wrong column
    assert not fits(planned, [k.double(), v.double()])


def test_a_sibling_launch_refuses_outputs_that_are_not_column_slices_of_one_tensor():
    """The kernels write through raw offsets from the first output: anything else would write out of bounds."""
    tables = PointerTable(["q", "k"], 2, torch.device("cpu"))
    x = torch.zeros(4, 8)
    fused = torch.zeros(4, 30)
    with pytest.raises(AssertionError, match="column slices"):  # k runs past the end of q's rows
        sibling_launch([fused[:, :20], torch.zeros(8, 30)[4:, :20]], x, tables, ["q", "k"], 4, 4, 64, 64, 20)
    with pytest.raises(AssertionError):  # a transposed output
        sibling_launch([torch.zeros(30, 4).t()], x, tables, ["q"], 4, 4, 64, 64, 20)
    with pytest.raises(AssertionError):  # rows that do not match the input's
        sibling_launch([fused[:3]], x, tables, ["q"], 4, 4, 64, 64, 20)
