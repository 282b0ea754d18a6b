"""A packed adapter's modules as views of its flat buffer made when read (lora/packed.py): the same weights, ranks,
bytes and scales as the modules it was packed from, and a handful of objects for the garbage collector however many
modules it has."""

import gc

import pytest
import torch

from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.packed import PackedModules
from loraplex.lora.device.upload import AdapterUploader


def many_modules(count: int, seed: int) -> dict[str, LoraWeights]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.proj": LoraWeights(torch.randn(1 + i % 4, 16, generator=g),
                                            torch.randn(24, 1 + i % 4, generator=g), 0.25 * (1 + i % 3))
            for i in range(count)}


def test_packed_modules_read_as_the_modules_they_were_packed_from():
    original = LoraAdapter("a", many_modules(12, 0), LoraConfig(r=4, lora_alpha=8))
    packed = original.packed()
    assert isinstance(packed.modules, PackedModules)
    assert list(packed.modules) == list(original.modules) and len(packed.modules) == 12
    for name, w in original.modules.items():
        got = packed.modules[name]
        assert torch.equal(got.a, w.a) and torch.equal(got.b, w.b) and got.scale == w.scale
        assert got.a.data_ptr() >= packed.flat.data_ptr()  # a view of the flat buffer, not a copy
    assert "layers.0.proj" in packed.modules and "nope" not in packed.modules
    with pytest.raises(KeyError):
        packed.modules["nope"]
    assert (packed.max_rank, packed.nbytes) == (original.max_rank, original.nbytes)
    assert packed.layout is packed.modules.layout and packed.fingerprint == original.fingerprint
    uploaded = AdapterUploader(torch.device("cpu"), torch.float32).upload(packed.modules, packed.flat, packed.layout)
    assert uploaded.scales == tuple(w.scale for w in original.modules.values())


def test_a_packed_adapter_holds_a_few_tracked_objects_whatever_its_module_count():
    def tracked_per_adapter(count: int) -> float:
        gc.collect()
        before = len(gc.get_objects())
        adapters = [LoraAdapter(f"a{k}", many_modules(count, k), LoraConfig(r=4, lora_alpha=8)).packed()
                    for k in range(20)]
        gc.collect()
        per_adapter = (len(gc.get_objects()) - before) / len(adapters)
        del adapters
        return per_adapter

    few, many = tracked_per_adapter(4), tracked_per_adapter(64)
    assert many < 30 and many - few < 5  # a dict of 64 LoraWeights alone would hold 192 (weights and views)
