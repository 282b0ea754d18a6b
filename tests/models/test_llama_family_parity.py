"""Llama-family parity with transformers on tiny random-weight configs: logits close, greedy identical."""

from dataclasses import replace

import pytest
import torch

from loraplex.engine.loading import build_model
from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, ours_from_hf, tiny_hf_model

GEMMA2 = {"head_dim": 32, "sliding_window": 12, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.05,
          "final_logit_softcapping": 0.5}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-untied-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    # Qwen2.5's long-context recipe, its original context shrunk so the prompts and tokens run past it.
    "qwen2-yarn": ("qwen2", {"max_position_embeddings": 64,
                             "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    "mistral-sliding": ("mistral", {"sliding_window": 12}),
    "qwen2-bias": ("qwen2", {}),
    # transformers slides only the layers from max_window_layers on: here the second of two.
    "qwen2-window-from-layer-1": ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    # q/k norms over each head; head_dim 32, not hidden / heads (16), as Qwen3's configs set it apart.
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # norms scaling by 1 + weight, embeddings by sqrt(hidden), the tanh GELU (its legacy "gelu" name), tied head.
    "gemma": ("gemma", {"head_dim": 32, "hidden_act": "gelu"}),
    # Gemma's, with scores and logits soft-capped (caps small enough that random weights' scores reach them),
    # query_pre_attn_scalar, a norm each side of attention and MLP, every other layer sliding (transformers' default).
    "gemma2": ("gemma2", GEMMA2),
    # q/k/v as one qkv_proj, gate/up as one gate_up_proj; Phi-3 slides every layer when sliding_window is set.
    "phi3": ("phi3", {"pad_token_id": 0}),
    "phi3-sliding": ("phi3", {"pad_token_id": 0, "sliding_window": 12}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),  # q/k/v and o_proj biases, as transformers builds
    "qwen3-window-from-layer-1": ("qwen3", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
}

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 1, 64, 128, 11, 12, 13, 14, 15, 16, 200, 201, 202, 9, 8, 7], [3, 1, 4, 1, 5], [77]]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request):
    kind, overrides = VARIANTS[request.param]
    hf = tiny_hf_model(kind, **overrides)
    ours, config = ours_from_hf(hf)
    return hf, ours, config


def test_logits_match_transformers(pair):
    hf, ours, config = pair
    for prompt in PROMPTS:
        expected = hf(torch.tensor([prompt])).logits[0].float()
        got = full_logits(ours, config, prompt)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(pair):
    hf, ours, config = pair
    engine = engine_for(ours, config)
    new = 24  # long enough to cross the sliding window and a KV block boundary
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new)
        assert result.token_ids == expected[0, len(prompt):].tolist()


def test_gemma2_soft_caps_matter():
    """Each cap changes the logits of the variant above, so its parity tests cover the caps."""
    hf = tiny_hf_model("gemma2", **GEMMA2)
    _, config = ours_from_hf(hf)
    expected = full_logits(*ours_from_hf(hf), PROMPTS[0])
    for uncapped in (replace(config, attention_softcap=None), replace(config, final_logit_softcap=None)):
        model = build_model(uncapped, {k: v.detach().clone() for k, v in hf.state_dict().items()})
        assert (full_logits(model, uncapped, PROMPTS[0]) - expected).abs().max() > 1e-2
