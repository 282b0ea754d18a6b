"""Each RoPE scaling kind against transformers' own rotary embedding, at positions well past the original context,
from the config as published (shrunk): the frequencies, YaRN's attention factor on cos and sin, and the defaults
transformers fills in."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.hf_config import rope_from_hf

HEAD_DIM = 32
POSITIONS = torch.arange(0, 200, 3)  # the original contexts below are 16-64 positions

SCALINGS = {
    "yarn-qwen2.5": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-deepseek-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                             "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 16},
    "yarn-stated-attention-factor": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9,
                                     "original_max_position_embeddings": 64, "truncate": False},
    "yarn-factor-from-the-context-ratio": {"rope_type": "yarn", "factor": None,
                                           "original_max_position_embeddings": 32},
    "llama3-context-from-the-model": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0},
}


def hf_config(scaling: dict) -> dict:
    return {"hidden_size": HEAD_DIM * 4, "num_attention_heads": 4, "max_position_embeddings": 128,
            "rope_parameters": {"rope_theta": 10000.0, **scaling}}


def ours(hf: dict) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = RotaryEmbedding(rope_from_hf(hf), HEAD_DIM)(POSITIONS, torch.float32)
    return cos[:, 0], sin[:, 0]


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_cos_and_sin_match_transformers_past_the_original_context(name):
    hf = hf_config(SCALINGS[name])
    reference = LlamaRotaryEmbedding(LlamaConfig(**hf))
    cos, sin = reference(torch.zeros(1, len(POSITIONS), HEAD_DIM), POSITIONS[None])
    got_cos, got_sin = ours(hf)
    torch.testing.assert_close(got_cos, cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_sin, sin[0], atol=1e-5, rtol=1e-5)
    # The scaling is really in effect: unscaled angles differ.
    plain_cos, _ = ours(hf_config({"rope_type": "default"}))
    assert (plain_cos - got_cos).abs().max() > 0.05


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    rope = rope_from_hf(hf_config(SCALINGS["yarn-qwen2.5"]))
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    cos, sin = ours(hf_config(SCALINGS["yarn-qwen2.5"]))
    assert (cos**2 + sin**2).sqrt().mean().item() == pytest.approx(rope.attention_factor, rel=1e-5)


def test_a_ramp_in_the_wrong_order_and_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="beta_fast"):
        rope_from_hf(hf_config({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 32}))
    with pytest.raises(ValueError, match="unsupported rope scaling 'su'"):
        rope_from_hf(hf_config({"rope_type": "su", "factor": 4.0}))
