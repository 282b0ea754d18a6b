"""The Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms over each
head), Gemma (norms scaling by 1 + weight, embeddings by sqrt(hidden), tanh GELU), Gemma 2 (Gemma's, with
soft-capped attention scores and logits, query_pre_attn_scalar, a norm each side of attention and MLP, every
other layer sliding), Phi-3 (q/k/v and gate/up each
one linear in its checkpoints), tied or untied embeddings, grouped-query attention, a sliding window on every layer or on some (Qwen's
max_window_layers, transformers' layer_types), Mixtral and Qwen2-MoE (a mixture of experts in place of the MLP of
their sparse layers; models/moe.py, layers/moe.py). Parameter names match Hugging Face checkpoints.

The model runs on flat token rows: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`.
Which rows belong to which sequence is the attention layer's business (the forward context).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.models.config import ModelConfig
from loraplex.layers.activation import act_and_mul
from loraplex.layers.attention import PagedAttention
from loraplex.layers.moe import MoeExperts, SparseMoeBlock
from loraplex.layers.norms import RMSNorm
from loraplex.layers.projections import project
from loraplex.layers.rotary import RotaryEmbedding, apply_rotary
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.hf_config import rope_context, rope_from_hf
from loraplex.models import moe as moe_checkpoints

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaAttention(nn.Module):
    SIBLINGS = (("q_proj", "k_proj", "v_proj"),)  # one product when fused (layers/projections.py)

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        self.fused = config.fused_projections
        if self.fused:  # Phi-3: one linear as published (its siblings are fused already)
            self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=bias)
            self.SIBLINGS = ()
        else:
            self.q_proj = nn.Linear(config.hidden_size, self.sizes[0], bias=bias)
            self.k_proj = nn.Linear(config.hidden_size, self.sizes[1], bias=bias)
            self.v_proj = nn.Linear(config.hidden_size, self.sizes[2], bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.output_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        slides = config.sliding_layers is None or config.sliding_layers[layer_index]
        scale = config.attention_scale or self.head_dim**-0.5
        self.attn = PagedAttention(layer_index, self.num_heads, self.num_kv_heads, self.head_dim, scale,
                                   config.sliding_window if slides else None, softcap=config.attention_softcap)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.fused:
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            q, k, v = project(self, x, ("q_proj", "k_proj", "v_proj"))
        q = q.view(rows, self.num_heads, self.head_dim)
        k = k.view(rows, self.num_kv_heads, self.head_dim)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v).reshape(rows, -1))


class LlamaMLP(nn.Module):
    SIBLINGS = (("gate_proj", "up_proj"),)

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = config.mlp_bias
        size = intermediate_size or config.intermediate_size  # Qwen2-MoE's shared expert: its own
        self.fused = config.fused_projections
        if self.fused:  # Phi-3: gate then up, in one linear
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=bias)
            self.SIBLINGS = ()
        else:
            self.gate_proj = nn.Linear(config.hidden_size, size, bias=bias)
            self.up_proj = nn.Linear(config.hidden_size, size, bias=bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(act_and_mul(self.act, *self.gate_up_proj(x).chunk(2, dim=-1)))
        return self.down_proj(act_and_mul(self.act, *project(self, x, ("gate_proj", "up_proj"))))


def feed_forward(config: ModelConfig, layer_index: int) -> nn.Module:
    """A layer's MLP, or on the sparse layers of Mixtral and Qwen2-MoE its mixture of experts (layers/moe.py)."""
    moe = config.moe
    if moe is None or not moe.sparse_layers[layer_index]:
        return LlamaMLP(config)
    shared = LlamaMLP(config, moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size else None
    return SparseMoeBlock(config.hidden_size, moe, ACTIVATIONS[config.hidden_act], shared)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma 2: post_attention_layernorm normalises the attention's output instead
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.mlp = feed_forward(config, layer_index)

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
        if self.sandwich:
            attended = self.post_attention_layernorm(self.self_attn(rope, normed))
            normed, x = self.pre_feedforward_layernorm.add_and_norm(attended, x)
            return x, self.post_feedforward_layernorm(self.mlp(normed))
        normed, x = self.post_attention_layernorm.add_and_norm(self.self_attn(rope, normed), x)
        return x, self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.embedding_scale = config.embedding_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the layers take them (Gemma's scaled by sqrt(hidden), rounded to their dtype)."""
        x = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        return x

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        # `inputs_embeds` [T, hidden]: rows already embedded (image features in placeholder rows).
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
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
        return self.model.embed(input_ids)

    # Mixtral's and Qwen2-MoE's checkpoints name experts one by one (models/moe.py); the loader stacks them.
    checkpoint_name = staticmethod(moe_checkpoints.checkpoint_name)

    def joined_checkpoint_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (our names) with per-expert tensors stacked as our experts hold them (weights.load_into asks)."""
        experts = [(name, m.num_experts) for name, m in self.named_modules() if isinstance(m, MoeExperts)]
        return moe_checkpoints.stack_experts(state, experts) if experts else state

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", *moe_checkpoints.MOE_TYPES)
_QWEN = ("qwen2", "qwen3")
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def sliding_layers(hf: dict[str, Any], num_layers: int, sliding_window: int | None) -> tuple[bool, ...] | None:
    """Which layers slide, as transformers decides it: its `layer_types` when the config lists them; for Qwen2 and
    Qwen3 the layers from `max_window_layers` on; otherwise every layer (None)."""
    if sliding_window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != num_layers
                or any(t not in _LAYER_TYPES for t in layer_types)):
            raise ValueError(f"config.json: layer_types must list {num_layers} of {', '.join(_LAYER_TYPES)}; got "
                             f"{str(layer_types)[:120]}")
        return tuple(_LAYER_TYPES[t] for t in layer_types)
    if hf.get("model_type") == "gemma2":  # transformers' default: every other layer, from the first
        return tuple(i % 2 == 0 for i in range(num_layers))
    if hf.get("model_type") == "qwen2_moe":  # transformers' default: the even layers below max_window_layers
        return tuple(i % 2 == 0 and i < hf.get("max_window_layers", 28) for i in range(num_layers))
    if hf.get("model_type") in _QWEN:
        first = hf.get("max_window_layers", 28)  # transformers' default for both
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"config.json: max_window_layers must be a whole number; got {first!r}")
        return tuple(i >= first for i in range(num_layers))
    return None


def llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3, Mixtral and Qwen2-MoE (config.json as transformers writes
    it) -> our ModelConfig."""
    model_type = hf.get("model_type", "llama")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    gemma2 = model_type == "gemma2"
    gemma = model_type == "gemma" or gemma2
    attention_bias = bool(hf.get("qkv_bias", True) if model_type == "qwen2_moe" else hf.get("attention_bias", model_type == "qwen2"))
    # Gemma 2 reads `hidden_activation` (its configs carry both)
    hidden_act = (gemma2 and hf.get("hidden_activation")) or hf.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    if gemma and hidden_act == "gelu":  # Gemma's legacy value, meant as the tanh approximation (transformers says so)
        hidden_act = "gelu_pytorch_tanh"
    sliding_window = hf.get("sliding_window") or None  # 0 turns it off in some configs
    if model_type in (*_QWEN, "qwen2_moe") and not hf.get("use_sliding_window", False):
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
        max_position_embeddings=rope_context(hf, hf.get("max_position_embeddings", 4096)),
        rope=rope_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        output_bias=attention_bias and model_type in ("llama", "qwen3", "gemma"),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hidden_act=hidden_act,
        sliding_window=sliding_window,
        sliding_layers=sliding_layers(hf, hf["num_hidden_layers"], sliding_window),
        qk_norm=model_type == "qwen3",
        fused_projections=model_type == "phi3",
        norm_offset=1.0 if gemma else 0.0,
        embedding_scale=hf["hidden_size"] ** 0.5 if gemma else None,
        attention_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5 if gemma2 else None,
        attention_softcap=hf.get("attn_logit_softcapping", 50.0) if gemma2 else None,
        final_logit_softcap=hf.get("final_logit_softcapping", 30.0) if gemma2 else None,
        sandwich_norms=gemma2,
        moe=moe_checkpoints.moe_from_hf(hf, hf["num_hidden_layers"]),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
