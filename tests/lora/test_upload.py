"""Adapter installs in one copy (lora/layout.py, lora/device/upload.py): the layout the per-row kernels read, adapters laid
out so on the host, the values and dtype of the weights handed back, and the slot tables pointing into the one
buffer."""

import pytest
import torch

from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.step.kernels import PointerTable
from loraplex.lora.layout import ALIGN, Layout
from loraplex.lora.device.upload import AdapterUploader


def modules(seed: int, ranks=(4, 16, 1)) -> dict[str, LoraWeights]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(24, 10), (7, 33), (64, 5)]
    return {
        f"m{i}": LoraWeights(torch.randn(rank, n_in, generator=g), torch.randn(n_out, rank, generator=g), 0.5 + i)
        for i, (rank, (n_in, n_out)) in enumerate(zip(ranks, shapes))
    }


def test_every_tensor_starts_aligned_and_none_overlap():
    layout = Layout.of(modules(0))
    spans = []
    for (a_at, rank, n_in, b_at, n_out), w in zip(layout.entries.values(), modules(0).values()):
        assert a_at % ALIGN == 0 and b_at % ALIGN == 0
        assert (rank, n_in, n_out) == (*w.a.shape, w.b.shape[0])
        spans += [(a_at, a_at + w.a.numel()), (b_at, b_at + w.b.numel())]
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.length


def test_a_packed_adapter_holds_the_same_weights_as_views_of_its_flat_buffer():
    original = LoraAdapter("a", modules(4), LoraConfig(r=16, lora_alpha=16), entry_key="a@1")
    packed = original.packed()
    assert packed.flat is not None and packed.flat.numel() == Layout.of(original.modules).length
    assert (packed.adapter_id, packed.entry_key, packed.config) == (original.adapter_id, "a@1", original.config)
    flat_start, flat_end = packed.flat.data_ptr(), packed.flat.data_ptr() + packed.flat.nbytes
    for name, w in packed.modules.items():
        assert torch.equal(w.a, original.modules[name].a) and torch.equal(w.b, original.modules[name].b)
        assert w.scale == original.modules[name].scale
        assert w.a.is_contiguous() and w.b.t().is_contiguous()
        assert all(flat_start <= t.data_ptr() < flat_end for t in (w.a, w.b))
    assert packed.fingerprint == original.fingerprint  # the same adapter to the prefix cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_adapter_uploads_from_its_flat_buffer_to_the_same_weights(dtype):
    adapter = LoraAdapter("a", modules(5), LoraConfig(r=16, lora_alpha=16)).packed()
    uploader = AdapterUploader(torch.device("cpu"), dtype)
    from_flat = uploader.upload(adapter.modules, adapter.flat, adapter.layout).weights()
    per_tensor = uploader.upload(adapter.modules).weights()
    for name, w in from_flat.items():
        assert torch.equal(w.a, per_tensor[name].a) and torch.equal(w.b, per_tensor[name].b)
        assert w.a.dtype == dtype and w.scale == per_tensor[name].scale
    # In the slots' dtype the CPU slot reads the adapter's own buffer (no copy at the install); in another, a copy.
    shares = from_flat["m1"].a.data_ptr() == adapter.modules["m1"].a.data_ptr()
    assert shares == (dtype == adapter.flat.dtype)


def test_uploaded_weights_equal_the_adapter_in_the_slots_dtype_as_views_of_one_buffer():
    original = modules(1)
    uploaded = AdapterUploader(torch.device("cpu"), torch.bfloat16).upload(original).weights()
    assert uploaded.keys() == original.keys()
    storages = set()
    for name, w in uploaded.items():
        assert w.a.dtype == w.b.dtype == torch.bfloat16 and w.scale == original[name].scale
        torch.testing.assert_close(w.a, original[name].a.to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(w.b, original[name].b.to(torch.bfloat16), rtol=0, atol=0)
        assert w.a.is_contiguous() and w.b.t().is_contiguous()  # A and B.T dense, row-major
        storages.add(w.a.untyped_storage().data_ptr())
        storages.add(w.b.untyped_storage().data_ptr())
    assert len(storages) == 1


def test_uploads_do_not_share_memory_and_the_tables_point_into_each():
    uploader = AdapterUploader(torch.device("cpu"), torch.float32)
    first, second = uploader.upload(modules(2)).weights(), uploader.upload(modules(3, ranks=(2, 2, 2))).weights()
    assert first["m0"].a.untyped_storage().data_ptr() != second["m0"].a.untyped_storage().data_ptr()
    torch.testing.assert_close(first["m1"].a, modules(2)["m1"].a)  # the second upload left the first intact
    tables = PointerTable(["m0", "m1", "m2", "absent"], 2, torch.device("cpu"))
    tables.set_slot(0, first)
    tables.set_slot(1, {"m1": second["m1"]})
    pointers, ranks, scales = tables.layer("m1")
    assert pointers[0].tolist() == [first["m1"].a.data_ptr(), first["m1"].b.t().data_ptr()]
    assert pointers[1].tolist() == [second["m1"].a.data_ptr(), second["m1"].b.t().data_ptr()]
    assert ranks.tolist() == [16, 2] and scales.tolist() == [1.5, 1.5]
    assert tables.layer("m0")[1].tolist() == [4, 0]
    assert tables.targeted == frozenset({"m0", "m1", "m2"})
    tables.set_slot(0, {})
    assert tables.targeted == frozenset({"m1"}) and tables.layer("m1")[1].tolist() == [0, 2]


def test_the_tables_point_at_an_upload_from_its_layout_as_at_its_views():
    """`set_slot_uploaded` (installs: addresses from the layout's offsets) writes what `set_slot` writes from the
    per-module views, and clears the layers the new adapter does not target."""
    uploader = AdapterUploader(torch.device("cpu"), torch.float32)
    names = ["m0", "m1", "m2", "absent"]
    by_layout, by_views = PointerTable(names, 3, torch.device("cpu")), PointerTable(names, 3, torch.device("cpu"))
    for slot, seed in [(0, 6), (2, 7)]:
        uploaded = uploader.upload(modules(seed, ranks=(8, 2, 5)))
        by_layout.set_slot_uploaded(slot, uploaded)
        by_views.set_slot(slot, uploaded.weights())
    for name in names:
        for got, expected in zip(by_layout.layer(name), by_views.layer(name)):
            assert torch.equal(got, expected)
    assert by_layout.layer("m2")[1].tolist() == [5, 0, 5] and by_layout.layer("m0")[2].tolist() == [0.5, 0, 0.5]
    assert by_layout.targeted == by_views.targeted == frozenset({"m0", "m1", "m2"})
    two_modules = uploader.upload({"m1": modules(8)["m1"]})
    by_layout.set_slot_uploaded(0, two_modules)  # replaces slot 0: m0 and m2 no longer targeted there
    assert by_layout.layer("m0")[1].tolist() == [0, 0, 8] and by_layout.layer("m1")[1].tolist() == [16, 0, 2]
    assert by_layout.layer("m1")[0][0].tolist() == [two_modules.buffer.data_ptr(),
                                                    two_modules.weights()["m1"].b.data_ptr()]


def test_slots_hand_out_each_installed_adapters_weights_and_none_after_a_replacement_or_clear():
    """`AdapterTable` keeps each slot's upload and makes its per-module views on first use (the segment forms'):
    they are the adapter's weights, a replacement's after an install, and nothing after a clear."""
    from torch import nn

    from loraplex.lora.device.table import AdapterTable

    model = nn.Sequential(nn.Linear(24, 10), nn.Linear(7, 33), nn.Linear(64, 5))
    slots = AdapterTable(model, num_slots=2, device=torch.device("cpu"), dtype=torch.float32, max_rank=16)
    first = LoraAdapter("a", {str(i): w for i, w in enumerate(modules(9).values())}, LoraConfig(r=16, lora_alpha=16))
    second = LoraAdapter("b", {"1": modules(10, ranks=(4, 2, 1))["m1"]}, LoraConfig(r=2, lora_alpha=2)).packed()
    slots.install(0, first)
    slots.install(1, second)
    for name, w in first.modules.items():
        assert torch.equal(slots.columns[name][0].a, w.a) and torch.equal(slots.columns[name][0].b, w.b)
        assert slots.columns[name][0].scale == w.scale
    assert slots.columns["0"][1] is None and torch.equal(slots.columns["1"][1].b, second.modules["1"].b)
    slots.install(0, second)  # replaced: the views are the new adapter's
    assert slots.columns["0"][0] is None and torch.equal(slots.columns["1"][0].a, second.modules["1"].a)
    slots.clear(1)
    assert all(slots.columns[name][1] is None for name in "012")
    assert slots.pointers.targeted == frozenset({"1"})


def test_asking_for_a_layer_an_adapter_does_not_target_makes_no_views(monkeypatch):
    """Every eager step asks each of its slots for the head's weights (the logits rows): where the adapter does not
    target the head, the answer comes from its layout, without the per-module views of all its layers."""
    from torch import nn

    from loraplex.lora.device.table import AdapterTable
    from loraplex.lora.device.upload import Uploaded

    made = []
    views = Uploaded.weights
    monkeypatch.setattr(Uploaded, "weights", lambda self: made.append(self) or views(self))
    model = nn.Sequential(nn.Linear(24, 10), nn.Linear(7, 33), nn.Linear(64, 5))
    slots = AdapterTable(model, num_slots=2, device=torch.device("cpu"), dtype=torch.float32, max_rank=16)
    adapter = LoraAdapter("a", {"1": modules(11)["m1"]}, LoraConfig(r=16, lora_alpha=16)).packed()
    slots.install(0, adapter)
    assert slots.columns["0"][0] is None and slots.columns["2"][0] is None and slots.columns["1"][1] is None
    assert made == []
    assert torch.equal(slots.columns["1"][0].a, adapter.modules["1"].a) and len(made) == 1
    assert slots.columns["1"][0] is slots.columns["1"][0] and len(made) == 1  # made once per install
