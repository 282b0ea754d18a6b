"""The example Mllama model `loraplex/smollm2-mllama-shapes`: the parts assemble (cached, keyed by the parts)
into a complete checkpoint with the tensor names and shapes transformers 5 writes for
MllamaForConditionalGeneration, SmolLM2's weights in the self-attention layers and as lm_head."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from loraplex.checkpoints.sources import resolve_model
from loraplex.example_models.assembly import ADDED_EMBEDDINGS, PARTS_FILE
from loraplex.example_models.mllama import (
    EXAMPLE_MLLAMA_MODEL_ID,
    EXTRA_EMBEDDING_ROWS,
    PARTS_DIR,
    _cache_key,
    base_layers,
    example_mllama_dir,
    module_name,
)

FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "processor_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def assembled():
    path = example_mllama_dir()
    return path, json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def base():
    return resolve_model(None).path


def tensors_of(path) -> safe_open:
    return safe_open(str(path / "model.safetensors"), framework="pt")


def test_directory_is_complete_and_cached(assembled):
    from loraplex.checkpoints.cache import cache_dir

    path, config = assembled
    assert all((path / name).is_file() for name in FILES), sorted(p.name for p in path.iterdir())
    assert path.parent == cache_dir() / "vision" and path.name.startswith("smollm2-mllama-shapes-")
    assert example_mllama_dir() == path  # the second call finds it
    assert resolve_model(EXAMPLE_MLLAMA_MODEL_ID).path == path
    assert config["model_type"] == "mllama" and config["architectures"] == ["MllamaForConditionalGeneration"]


def test_config(assembled, base):
    _, config = assembled
    text, vision = config["text_config"], config["vision_config"]
    smollm2 = json.loads((base / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert text[key] == smollm2[key], key
    assert text["rope_parameters"] == smollm2["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert text["num_hidden_layers"] == smollm2["num_hidden_layers"] + len(text["cross_attention_layers"])
    assert text["cross_attention_layers"] == [8, 17, 26]
    assert text["tie_word_embeddings"] is False
    assert config["image_token_index"] == smollm2["vocab_size"] == 49152
    assert vision["vision_output_dim"] == vision["hidden_size"] * (1 + len(vision["intermediate_layers_indices"]))
    assert vision["max_num_tiles"] == 2 and vision["supported_aspect_ratios"] == [[1, 1], [1, 2], [2, 1]]
    tokenizer = json.loads((assembled[0] / "tokenizer.json").read_text())
    image = [t for t in tokenizer["added_tokens"] if t["content"] == "<|image|>"]
    assert len(image) == 1 and image[0]["id"] == 49152 and image[0]["special"]


def test_tensor_names_and_shapes_are_transformers(assembled, tmp_path):
    """Names: as save_pretrained writes them for a (tiny) model of the same layout. Shapes: the model's."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    path, config = assembled
    with tensors_of(path) as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F32"}

    full = MllamaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(full)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {module_name(name): shape for name, shape in shapes.items()} == expected

    tiny = json.loads(json.dumps(config))
    tiny["text_config"].update(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                               num_key_value_heads=1)
    hidden = 8
    kept = len(tiny["vision_config"]["intermediate_layers_indices"])
    tiny["vision_config"].update(hidden_size=hidden, attention_heads=2, intermediate_size=16, image_size=28,
                                 vision_output_dim=hidden * (1 + kept))
    tiny["image_token_index"] = 64
    MllamaForConditionalGeneration(MllamaConfig.from_dict(tiny)).save_pretrained(tmp_path)
    with tensors_of(tmp_path) as f:
        assert set(f.keys()) == set(shapes)
    assert shapes["language_model.lm_head.weight"] == (49152, 576)
    assert shapes["language_model.model.embed_tokens.weight"] == (49152 + EXTRA_EMBEDDING_ROWS, 576)


def test_base_layers():
    sources = base_layers(33, [8, 17, 26])
    assert [sources[i] for i in range(33)] == [
        *range(8), 7, *range(8, 16), 15, *range(16, 24), 23, *range(24, 30)
    ]
    assert base_layers(3, [0])[0] == 0
    with pytest.raises(ValueError):
        base_layers(3, [3])


def test_smollm2_weights_are_in_place(assembled, base):
    path, config = assembled
    text = config["text_config"]
    cross = set(text["cross_attention_layers"])
    sources = base_layers(text["num_hidden_layers"], text["cross_attention_layers"])
    with tensors_of(path) as f, tensors_of(base) as g, safe_open(str(PARTS_DIR / PARTS_FILE), framework="pt") as parts:
        embed = g.get_tensor("model.embed_tokens.weight")
        assert torch.equal(f.get_tensor("language_model.lm_head.weight"), embed)
        assembled_embed = f.get_tensor("language_model.model.embed_tokens.weight")
        assert torch.equal(assembled_embed[: embed.shape[0]], embed)
        assert torch.equal(assembled_embed[embed.shape[0]:], parts.get_tensor(ADDED_EMBEDDINGS).float())
        assert torch.equal(f.get_tensor("language_model.model.norm.weight"), g.get_tensor("model.norm.weight"))
        base_names = [n.split(".", 3)[3] for n in g.keys() if n.startswith("model.layers.0.")]
        assert len(base_names) == 9
        for index, source in sources.items():
            for rest in base_names:
                name = f"language_model.model.layers.{index}.{rest}"
                if index in cross and not rest.startswith("mlp."):
                    assert name in parts.keys() or rest.startswith("self_attn."), name
                    continue
                assert torch.equal(f.get_tensor(name), g.get_tensor(f"model.layers.{source}.{rest}")), name
        for name in parts.keys():  # every trained tensor, cast up from float16
            if name != ADDED_EMBEDDINGS:
                assert torch.equal(f.get_tensor(name), parts.get_tensor(name).float()), name


def test_cache_key_follows_the_parts(tmp_path, base):
    parts = tmp_path / "parts"
    shutil.copytree(PARTS_DIR, parts)
    key = _cache_key(parts, base)
    assert _cache_key(PARTS_DIR, base) == key
    (parts / "config.json").write_text((parts / "config.json").read_text() + "\n")
    assert _cache_key(parts, base) != key


def test_missing_parts_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{PARTS_FILE}.*train_mllama.py"):
        example_mllama_dir(parts_dir=tmp_path)


def test_module_names():
    assert module_name("language_model.lm_head.weight") == "lm_head.weight"
    gate = "layers.8.cross_attn_attn_gate"
    assert module_name(f"language_model.model.{gate}") == f"model.language_model.{gate}"
    assert module_name("vision_model.class_embedding") == "model.vision_model.class_embedding"
    assert module_name("multi_modal_projector.bias") == "model.multi_modal_projector.bias"
    with pytest.raises(ValueError):
        module_name("model.embed_tokens.weight")
