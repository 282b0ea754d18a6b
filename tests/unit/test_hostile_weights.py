"""Model checkpoints that lie: safetensors headers refused before safetensors opens any shard, shard indexes
that point outside the model directory, and config.json / generation_config.json with wrong types, absurd
sizes, deep nesting or a huge size, each refused with a one-line error naming the field."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import WeightsError, load_state_dict
from loraplex.engine import loading
from loraplex.models.registry import config_from_hf
from tests.hostile_safetensors import ENTRY, LIE_PARAMS, craft, nothing_read

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def model_dir(tmp_path, config: dict | None = None, shards: dict[str, bytes] | None = None):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or LLAMA))
    for name, data in (shards or {}).items():
        (path / name).write_bytes(data)
    if shards and len(shards) > 1:
        index = {"weight_map": {f"t{i}": name for i, name in enumerate(shards)}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def honest() -> bytes:
    return craft({"t": ENTRY})


def test_an_honest_checkpoint_loads_through_the_guarded_function(tmp_path, monkeypatch):
    calls, real = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    state = load_state_dict(model_dir(tmp_path, shards={"model.safetensors": honest()}))
    assert torch.equal(state["t"], torch.zeros(2, 2)) and calls  # so the guard below guards the real read


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "second-shard"])
@pytest.mark.parametrize("data, words", LIE_PARAMS)
def test_a_lying_header_is_refused_before_any_shard_is_opened(tmp_path, monkeypatch, data, words, sharded):
    shards = {"a.safetensors": honest(), "b.safetensors": data} if sharded else {"model.safetensors": data}
    path = model_dir(tmp_path, shards=shards)
    with nothing_read(monkeypatch, safetensors, "safe_open"), pytest.raises(WeightsError) as info:
        load_state_dict(path)
    name = "b.safetensors" if sharded else "model.safetensors"
    assert f"{name} is not a valid safetensors file: " in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "x.bin", 3])
def test_an_index_naming_files_outside_the_directory_is_refused(tmp_path, shard):
    path = model_dir(tmp_path, shards={"a.safetensors": honest(), "b.safetensors": honest()})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t": shard}}))
    with pytest.raises(WeightsError, match="weight_map must map tensor names to .safetensors files in the directory"):
        load_state_dict(path)


@pytest.mark.parametrize("text, words", [
    pytest.param("{not json", "cannot read", id="not-json"),
    pytest.param("[1, 2]", "not a JSON object", id="not-an-object"),
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="nested-100000-deep"),
    pytest.param('{"a": "' + "x" * (17 << 20) + '"}', "larger than 16777216 bytes", id="huge-file"),
])
def test_a_config_json_that_is_no_config_is_refused(tmp_path, text, words):
    path = model_dir(tmp_path, shards={"model.safetensors": honest()})
    (path / "config.json").write_text(text)
    with pytest.raises(WeightsError, match=words):
        resolve_model(str(path))


# (base config, field as written, value, words). Nested fields are "outer.inner".
T5 = {"model_type": "t5", "vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_heads": 4, "num_layers": 2}
MPT = {"model_type": "mpt", "vocab_size": 64, "d_model": 16, "n_heads": 4, "n_layers": 2, "attn_config": {}}
BART = {"model_type": "bart", "vocab_size": 64, "d_model": 16, "decoder_attention_heads": 4,
        "encoder_attention_heads": 4}
LLAVA = {"model_type": "llava_next", "text_config": {**LLAMA, "vocab_size": 100}, "vision_config": {}}
BAD_FIELDS = [
    (LLAMA, "hidden_size", "x", "hidden_size must be an integer in [1, 1048576]; got 'x'"),
    (LLAMA, "num_hidden_layers", -1, "num_hidden_layers must be an integer in [1, 4096]; got -1"),
    (LLAMA, "num_hidden_layers", 10**9, "got 1000000000"),
    (LLAMA, "num_hidden_layers", 1e9, "got 1000000000.0"),
    (LLAMA, "num_attention_heads", 0, "num_attention_heads must be an integer"),
    (LLAMA, "vocab_size", None, "vocab_size must be an integer in [1, 16777216]; got None"),
    (LLAMA, "vocab_size", True, "got True"),
    (LLAMA, "intermediate_size", 2**40, "intermediate_size must be an integer"),
    (LLAMA, "rope_scaling", "linear", "rope_scaling must be an object; got 'linear'"),
    (LLAMA, "rope_scaling.factor", "x", "rope_scaling.factor must be a number"),
    (LLAMA, "rope_scaling.factor", 0, "rope_scaling.factor must be a number in [0.001, 1000000]"),
    (LLAMA, "rope_theta", float("inf"), "rope_theta must be a number"),
    (LLAMA, "rms_norm_eps", float("nan"), "rms_norm_eps must be a number in [0, 1]; got nan"),
    (LLAMA, "eos_token_id", [2, "x"], "eos_token_id must be an integer or a list of integers"),
    (LLAMA, "tie_word_embeddings", "no", "tie_word_embeddings must be true or false"),
    (LLAMA, "hidden_act", ["silu"], "hidden_act must be a string"),
    (T5, "d_kv", "4", "d_kv must be an integer"),
    (T5, "num_heads", [4], "num_heads must be an integer"),
    (MPT, "n_heads", 0, "n_heads must be an integer"),
    (MPT, "attn_config", [1], "attn_config must be an object"),
    (MPT, "attn_config.kv_n_heads", "x", "attn_config.kv_n_heads must be an integer"),
    (BART, "d_model", None, "d_model must be an integer"),
    (BART, "encoder_layers", -3, "encoder_layers must be an integer"),
    (LLAVA, "text_config.hidden_size", "x", "text_config.hidden_size must be an integer"),
    (LLAVA, "vision_config.patch_size", 0, "vision_config.patch_size must be an integer"),
    (LLAVA, "vision_config", "clip", "vision_config must be an object"),
]


@pytest.mark.parametrize("base, field, value, words", [
    pytest.param(*case, id=f"{case[0]['model_type']}-{case[1]}-{case[2]!r}"[:60]) for case in BAD_FIELDS
])
def test_config_fields_of_the_wrong_type_or_size_are_refused_in_one_line(base, field, value, words):
    config = json.loads(json.dumps(base))
    *outer, leaf = field.split(".")
    target = config
    for name in outer:
        target = target.setdefault(name, {})
    target[leaf] = value
    with pytest.raises(ValueError) as info:
        config_from_hf(config)
    message = str(info.value)
    assert message.startswith("config.json: ") and words in message and "\n" not in message


def test_the_base_configs_above_are_accepted():
    for base in (LLAMA, T5, MPT, BART):
        assert config_from_hf(base).vocab_size == 64


def test_llama3_rope_needs_a_frequency_band():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}
    with pytest.raises(ValueError, match="high_freq_factor 4.0: must exceed low_freq_factor 4.0"):
        config_from_hf({**LLAMA, "rope_scaling": rope})


@pytest.mark.parametrize("eos, words", [("x", "eos_token_id 'x'"), ([1, 999], "999"), ({"a": 1}, "eos_token_id")])
def test_generation_config_eos_ids_are_checked(tmp_path, eos, words):
    path = model_dir(tmp_path, shards={"model.safetensors": honest()})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    source = resolve_model(str(path))
    with pytest.raises(ValueError, match=words):
        loading._generation_eos_ids(source, config_from_hf(source.hf_config))
