"""Random-weight models of real shapes for GPU benchmarks (no checkpoint can be downloaded on the lent machines)."""

from __future__ import annotations

import argparse

import torch

from loraplex.engine.loading import LoadedModel

LLAMA_8B_VOCAB = 49152  # Llama-3.1-8B's shape with the vocabulary cut, as the other GPU benchmarks use


def llama_8b(device: torch.device, layers: int = 32, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """A random model of Llama-3.1-8B's shape (hidden 4096, 32 heads, 8 KV heads, intermediate 14336), no tokenizer."""
    from benchmarks.quantization import llama_config, random_model

    shape = argparse.Namespace(vocab=LLAMA_8B_VOCAB, hidden=4096, intermediate=14336, layers=layers, heads=32, kv_heads=8)
    config = llama_config(shape)
    return LoadedModel(random_model(config, device, dtype, 0), config, None, device, dtype, f"random-llama-8b-shape-{layers}l")


def smollm2_135m(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """A random model of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, tied head), no
    tokenizer. On the H200 it carried a repeated random segment on (n-gram drafts were accepted), where the
    Llama-3.1-8B shape did not. (Those speculative figures were measured before `random_model` tied the head:
    the loop did not come from the tied head.)"""
    from benchmarks.quantization import random_model
    from loraplex.models.registry import config_from_hf

    config = config_from_hf({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    })
    return LoadedModel(random_model(config, device, dtype, 0), config, None, device, dtype, "random-smollm2-135m-shape")
