"""The GPU benchmark's models (benchmarks/gpu.py): random weights of SmolLM2-135M's and Llama-3.1-8B's shapes (tiny
shapes with `--smoke`), the transformers twin holding the same weights (the peers' model), and the wrapper that moves
the peers' inputs to the device."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from loraplex.models.config import ModelConfig
from loraplex.engine.loading import LoadedModel


def tiny_config(tied: bool) -> ModelConfig:
    """Smoke shapes: SmolLM2-like (tied head, default RoPE) or Llama-3.1-like (untied, llama3 RoPE)."""
    from benchmarks.quantization import llama_config

    config = llama_config(argparse.Namespace(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2))
    if tied:
        rope = dataclasses.replace(config.rope, kind="default")
        config = dataclasses.replace(config, tie_word_embeddings=True, rope=rope)
    return config


def build_model(kind: str, device: torch.device, dtype: torch.dtype, layers: int, smoke: bool) -> LoadedModel:
    from benchmarks.random_models import llama_8b, smollm2_135m

    if smoke:
        from benchmarks.quantization import random_model

        config = tiny_config(tied=kind == "135m")
        return LoadedModel(random_model(config, device, dtype, 0), config, None, device, dtype, f"tiny-{kind}")
    return smollm2_135m(device, dtype) if kind == "135m" else llama_8b(device, layers, dtype)


def hf_twin(loaded: LoadedModel):
    """A transformers LlamaForCausalLM of the same config holding a copy of our model's weights."""
    import transformers

    c = loaded.config
    rope_scaling = None
    if c.rope.kind == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": c.rope.factor, "low_freq_factor": c.rope.low_freq_factor,
                        "high_freq_factor": c.rope.high_freq_factor,
                        "original_max_position_embeddings": c.rope.original_max_position_embeddings}
    elif c.rope.kind != "default":
        raise ValueError(f"rope {c.rope.kind} not mapped")
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope.theta, rope_scaling=rope_scaling, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None, hidden_act=c.hidden_act,
    )
    with torch.device(loaded.device):
        hf = transformers.LlamaForCausalLM._from_config(hf_config, dtype=loaded.dtype, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(loaded.model.state_dict(), strict=False)
    allowed = {"lm_head.weight"} if c.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise RuntimeError(f"weights do not map onto transformers' Llama: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


class OnDevice:
    """A model whose `generate` gets its input tensors moved to `device` (the peers build them on the CPU)."""

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device

    def generate(self, **kwargs):
        return self.model.generate(**{k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                                      for k, v in kwargs.items()})
