"""The Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias), tied or untied
embeddings, grouped-query attention. Parameter names match Hugging Face checkpoints.

The model runs on flat token rows: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`.
Which rows belong to which sequence is the attention layer's business (the forward context).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.activation import act_and_mul
from loraplex.layers.attention import PagedAttention
from loraplex.layers.norms import RMSNorm
from loraplex.layers.projections import project
from loraplex.layers.rotary import RotaryEmbedding, apply_rotary
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.hf_config import rope_from_hf

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaAttention(nn.Module):
    SIBLINGS = (("q_proj", "k_proj", "v_proj"),)  # one product when fused (layers/projections.py)

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.attn = PagedAttention(
            layer_index, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, config.sliding_window
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = project(self, x, ("q_proj", "k_proj", "v_proj"))
        q = q.view(rows, self.num_heads, self.head_dim)
        k = k.view(rows, self.num_kv_heads, self.head_dim)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v).reshape(rows, -1))


class LlamaMLP(nn.Module):
    SIBLINGS = (("gate_proj", "up_proj"),)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.act, *project(self, x, ("gate_proj", "up_proj"))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x, output = self.residual_step(rope, x, None)
        return x + output

    def residual_step(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, pending: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer on the residual stream `x`, its output not yet added: (stream, output). `pending`, the
        layer before's output not yet added, is added here by the input norm (in a CUDA graph, one kernel for
        the add and the norm)."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            normed, x = self.input_layernorm.add_and_norm(pending, x)
        normed, x = self.post_attention_layernorm.add_and_norm(self.self_attn(rope, normed), x)
        return x, self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        # `inputs_embeds` [T, hidden]: rows already embedded (image features in placeholder rows).
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions, x.dtype)
        output = None
        for layer in self.layers:
            x, output = layer.residual_step(rope, x, output)
        return self.norm.add_and_norm(output, x)[0] if output is not None else self.norm(x)


class LlamaForCausalLM(nn.Module, ModelFamily):
    inputs = ModelInputs.TEXT

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Llama, Mistral and Qwen2 (config.json as transformers writes it) -> our ModelConfig."""
    model_type = hf.get("model_type", "llama")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    sliding_window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        sliding_window = None
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope=rope_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hidden_act=hf.get("hidden_act", "silu"),
        sliding_window=sliding_window,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
