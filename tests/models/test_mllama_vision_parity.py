"""Mllama (Llama 3.2 Vision) image encoder parity with transformers: a tiny random MllamaForConditionalGeneration,
its vision tensors loaded into our MllamaImageEncoder under the same names, images through the real
MllamaImageProcessor (tiles of 28x28, at most 2 per image, padding tiles and padding images included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from loraplex.checkpoints.weights import load_into
from loraplex.models.mllama_vision import (
    VISION_CHECKPOINT_RENAMES,
    MllamaImageEncoder,
    vision_config_from_hf,
)

transformers = pytest.importorskip("transformers")

TILE, TEXT_HIDDEN = 28, 64
VISION = dict(
    image_size=TILE, patch_size=14, hidden_size=32, attention_heads=4, intermediate_size=64, num_hidden_layers=2,
    num_global_layers=1, intermediate_layers_indices=[1, 0], vision_output_dim=32 * 3, max_num_tiles=2,
    supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
)
TEXT = dict(
    vocab_size=300, hidden_size=TEXT_HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, cross_attention_layers=[1], bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
PREFIXES = ("model.vision_model.", "model.multi_modal_projector.")


def image(height, width, seed):
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")


@pytest.fixture(scope="module")
def hf():
    """A random transformers Mllama whose gates, norms and biases are all away from their init values
    (the tile and position gates start at 0, which would hide the per-aspect-ratio embeddings)."""
    torch.manual_seed(0)
    config = transformers.MllamaConfig(
        vision_config=transformers.MllamaVisionConfig(**VISION), text_config=transformers.MllamaTextConfig(**TEXT)
    )
    model = transformers.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("gate"):
                p.copy_(torch.rand_like(p) + 0.3)
            elif "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "tile_embedding" in name or "tile_positional" in name:
                p.normal_()
    return model


@pytest.fixture(scope="module")
def ours(hf):
    settings = vision_config_from_hf(hf.config.vision_config.to_dict())
    holder = nn.Module()  # mounted as transformers mounts it: <parent>.model.{vision_model, multi_modal_projector}
    holder.model = MllamaImageEncoder(settings, hf.config.text_config.hidden_size)
    state = {k: v.clone() for k, v in hf.state_dict().items() if k.startswith(PREFIXES)}
    load_into(holder, state)
    return holder.model.eval()


@pytest.fixture(scope="module")
def processor():
    return transformers.MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=2)


def processed(processor, images):
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["aspect_ratio_ids"], out["aspect_ratio_mask"]


@torch.inference_mode()
def hf_states(hf, pixel_values, ids, mask):
    """`MllamaModel.forward`'s cross_attention_states."""
    states = hf.model.vision_model(pixel_values=pixel_values, aspect_ratio_ids=ids, aspect_ratio_mask=mask)
    states = states.last_hidden_state
    return hf.model.multi_modal_projector(states).reshape(-1, states.shape[-2], TEXT_HIDDEN)


def test_names_match_transformers(hf, ours):
    holder = nn.Module()
    holder.model = ours
    assert set(holder.state_dict()) == {k for k in hf.state_dict() if k.startswith(PREFIXES)}


def test_settings_defaults_are_transformers_defaults():
    assert vision_config_from_hf({}) == vision_config_from_hf(transformers.MllamaVisionConfig().to_dict())
    with pytest.raises(ValueError, match="vision_output_dim"):
        vision_config_from_hf({**VISION, "vision_output_dim": 64})


def test_checkpoint_renames():
    def rename(name):
        for pattern, replacement in VISION_CHECKPOINT_RENAMES:
            name = pattern.sub(replacement, name)
        return name

    assert rename("vision_model.patch_embedding.weight") == "model.vision_model.patch_embedding.weight"
    assert rename("multi_modal_projector.bias") == "model.multi_modal_projector.bias"
    assert rename("model.vision_model.class_embedding") == "model.vision_model.class_embedding"


CASES = {
    "one tile": [[image(30, 30, 0)]],  # padded to 2 tiles, the second masked
    "two tiles (1x2)": [[image(30, 60, 1)]],
    "two images, 2 and 1 tiles": [[image(30, 60, 2)], [image(33, 31, 3)]],
    "padding image": [[image(60, 30, 4), image(30, 60, 5)], [image(30, 30, 6)]],
}


@pytest.mark.parametrize("images", CASES.values(), ids=CASES.keys())
def test_cross_attention_states_match(hf, ours, processor, images):
    pixel_values, ids, mask = processed(processor, images)
    expected = hf_states(hf, pixel_values, ids, mask)
    with torch.inference_mode():
        got = ours(pixel_values, ids, mask)
    batch, count, tiles = mask.shape
    assert got.shape == expected.shape == (batch * count * tiles, ours.vision_model.num_patches, TEXT_HIDDEN)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_masked_tile_case_is_exercised(processor):
    _, ids, mask = processed(processor, CASES["padding image"])
    assert ids.tolist() == [[3, 2], [1, 0]]  # 0: a padding image
    assert mask.tolist() == [[[1, 1], [1, 1]], [[1, 0], [1, 0]]]


@torch.inference_mode()
def test_every_gate_matters(ours, processor):
    """The test bites: each tanh gate (tile, position, global attention and MLP) changes the output."""
    inputs = processed(processor, CASES["two images, 2 and 1 tiles"])
    before = ours(*inputs)
    gates = [(n, p) for n, p in ours.named_parameters() if n.rsplit(".", 1)[-1].startswith("gate")]
    assert {n.rsplit(".", 1)[-1] for n, _ in gates} == {"gate", "gate_attn", "gate_ffn"} and len(gates) == 5
    for name, gate in gates:
        saved = gate.clone()
        gate.zero_()
        assert not torch.allclose(ours(*inputs), before, atol=1e-3), name
        gate.copy_(saved)
    torch.testing.assert_close(ours(*inputs), before, atol=0, rtol=0)
