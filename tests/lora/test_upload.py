"""Adapter installs in one copy (lora/layout.py, lora/upload.py): the layout the per-row kernels read, adapters laid
out so on the host, the values and dtype of the weights handed back, and the slot tables pointing into the one
buffer."""

import pytest
import torch

from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.kernels import SlotPointers
from loraplex.lora.layout import ALIGN, Layout
from loraplex.lora.upload import AdapterUploader


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
    from_flat, per_tensor = uploader.upload(adapter.modules, adapter.flat), uploader.upload(adapter.modules)
    for name, w in from_flat.items():
        assert torch.equal(w.a, per_tensor[name].a) and torch.equal(w.b, per_tensor[name].b)
        assert w.a.dtype == dtype and w.scale == per_tensor[name].scale
    adapter.flat.zero_()  # the upload is a copy: the slot's weights never alias the adapter's host buffer
    assert from_flat["m1"].a.abs().sum() > 0


def test_uploaded_weights_equal_the_adapter_in_the_slots_dtype_as_views_of_one_buffer():
    original = modules(1)
    uploaded = AdapterUploader(torch.device("cpu"), torch.bfloat16).upload(original)
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
    first, second = uploader.upload(modules(2)), uploader.upload(modules(3, ranks=(2, 2, 2)))
    assert first["m0"].a.untyped_storage().data_ptr() != second["m0"].a.untyped_storage().data_ptr()
    torch.testing.assert_close(first["m1"].a, modules(2)["m1"].a)  # the second upload left the first intact
    tables = SlotPointers(["m0", "m1", "m2", "absent"], 2, torch.device("cpu"))
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
