"""Adapters whose safetensors lie: refused through the store with a message naming the lie (never the server's
path), before safetensors reads a byte of tensor data or anything is allocated from what the header says.

Pickles (`adapter_model.bin`), corrupt files and symlinks out of the roots are covered in test_store.py.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from safetensors.torch import save_file

import loraplex.lora.adapter as adapter_module
from loraplex.lora.adapter import ADAPTER_WEIGHTS, load_adapter_dir
from tests.hostile_safetensors import LIE_PARAMS, nothing_read
from tests.lora.test_store import BASE, MAX_RANK, P, lora_tensors, make_store, refused, write_adapter

Q0 = f"{P}model.layers.0.self_attn.q_proj"


@pytest.fixture
def store(tmp_path):
    (tmp_path / "root").mkdir()
    s = make_store(tmp_path / "root", refusal_ttl_s=0.0)
    yield s
    s.close()


def test_an_honest_adapter_is_read_through_the_guarded_function(store, tmp_path, monkeypatch):
    calls, real = [], adapter_module.owned_tensors
    monkeypatch.setattr(adapter_module, "owned_tensors", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    write_adapter(tmp_path / "root" / "a")
    assert store.load("a").max_rank == 4 and len(calls) == 1  # so the guard below guards the real read


@pytest.mark.parametrize("data, words", LIE_PARAMS)
def test_a_lying_header_is_refused_before_any_read(store, tmp_path, monkeypatch, data, words):
    path = write_adapter(tmp_path / "root" / "a")
    (path / ADAPTER_WEIGHTS).write_bytes(data)
    with nothing_read(monkeypatch, adapter_module, "owned_tensors"):
        message = refused(store, "a")
    assert words in message
    assert f"adapter 'a': {ADAPTER_WEIGHTS} is not a valid safetensors file" in message
    assert str(tmp_path) not in message and "\n" not in message


# Honest headers, tensors that cannot belong to this adapter: refused from the header, before the data is read.
@pytest.mark.parametrize("name, shape, words", [
    pytest.param(f"{Q0}.lora_A.weight", (4096, 16), "has shape [4096, 16]; expected [4, 16]", id="rank-far-too-large"),
    pytest.param(f"{Q0}.lora_B.weight", (4096, 4), "has shape [4096, 4]; expected [16, 4]", id="out-features-wrong"),
    pytest.param(f"{P}model.layers.0.mlp.big.weight", (1024, 1024), "not a LoRA A/B weight", id="stray-big-tensor"),
    pytest.param(f"{P}model.layers.0.self_attn.q_proj.base_layer.weight", (1024, 1024), "base-layer weight that differs",
                 id="base-copy-wrong-shape"),
])
def test_tensors_that_do_not_fit_are_refused_before_the_data_is_read(store, tmp_path, monkeypatch, name, shape, words):
    tensors = {**lora_tensors(), name: torch.zeros(shape)}
    write_adapter(tmp_path / "root" / "a", tensors=tensors)
    with nothing_read(monkeypatch, adapter_module, "owned_tensors"):
        message = refused(store, "a")
    assert name in message and words in message


def test_integer_lora_factors_are_refused_from_the_header(store, tmp_path, monkeypatch):
    tensors = {**lora_tensors(), f"{Q0}.lora_A.weight": torch.zeros(4, 16, dtype=torch.int32)}
    write_adapter(tmp_path / "root" / "a", tensors=tensors)
    with nothing_read(monkeypatch, adapter_module, "owned_tensors"):
        assert "has dtype I32; expected floats" in refused(store, "a")


def test_the_loader_names_no_path(tmp_path):
    path = write_adapter(tmp_path / "secret-place" / "a")
    save_file({"x": torch.zeros(2)}, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_WEIGHTS).write_bytes((path / ADAPTER_WEIGHTS).read_bytes() + b"trailing")
    with pytest.raises(Exception) as info:
        load_adapter_dir(path, "a", BASE, MAX_RANK)
    assert "cover" in str(info.value) and "secret-place" not in str(info.value)


def test_a_file_cut_short_while_it_is_loaded_fails_that_load_and_nothing_else(store, tmp_path, monkeypatch):
    """`cp new.safetensors over/an/adapter` truncates the file in place while a load reads it: that load is refused
    (the bytes read are not the file whose header was checked), the store keeps serving."""
    import loraplex.lora.adapter as adapter_module

    path = write_adapter(tmp_path / "root" / "a") / ADAPTER_WEIGHTS
    write_adapter(tmp_path / "root" / "b")
    real_check = adapter_module.check_layout

    def check_then_cut(*args, **kwargs):  # the header is read and checked; then the file shrinks
        real_check(*args, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)

    monkeypatch.setattr(adapter_module, "check_layout", check_then_cut)
    message = refused(store, "a")
    assert "changed while it was being read" in message and str(tmp_path) not in message
    monkeypatch.setattr(adapter_module, "check_layout", real_check)
    assert store.load("b").max_rank == 4


def test_a_file_cut_short_after_it_was_read_leaves_the_loaded_tensors_whole(store, tmp_path, monkeypatch):
    """The tensors live in memory of the process's own, not in a mapping of the file: truncating the file while
    they are being packed (which, mapped, killed the server with SIGBUS) changes nothing."""
    import loraplex.lora.adapter as adapter_module

    path = write_adapter(tmp_path / "root" / "a") / ADAPTER_WEIGHTS
    original = safetensors.torch.load(path.read_bytes())  # not load_file: its tensors map the file
    real_pack = adapter_module.adapter_from_tensors
    seen = {}

    def cut_then_pack(adapter_id, config, tensors, *args, **kwargs):
        with open(path, "r+b") as f:
            f.truncate(0)
        seen.update({name: tensor.clone() for name, tensor in tensors.items()})
        return real_pack(adapter_id, config, tensors, *args, **kwargs)

    monkeypatch.setattr(adapter_module, "adapter_from_tensors", cut_then_pack)
    assert store.load("a").max_rank == 4
    assert seen.keys() == original.keys() and all(torch.equal(seen[k], original[k]) for k in original)
