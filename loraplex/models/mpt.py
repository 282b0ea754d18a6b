"""MPT (MosaicML): pre-norm blocks with a fused Wqkv, ALiBi instead of rotary positions, a GELU MLP and
(by default) no biases and tied embeddings. Variants: multi-query / grouped-query attention, qkv clipping,
q/k LayerNorm, RMSNorm, biases (`no_bias` false) and logit scaling. Parameter names match transformers'
MptForCausalLM (and MosaicML's checkpoints, which use the same names).

The model runs on flat token rows: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`.
ALiBi is a score modifier of the paged attention layer, from absolute positions kept in the KV cache's
order, so `positions` is not read here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.layers.rotary import RopeConfig
from loraplex.models.config import ModelConfig, MptConfig
from loraplex.layers.alibi import alibi_slopes
from loraplex.layers.attention import PagedAttention
from loraplex.layers.norms import RMSNorm
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.hf_config import require


def mpt_norm(mpt: MptConfig, size: int) -> nn.Module:
    """MosaicML's norms: LayerNorm (bias unless no_bias; low-precision variants computed as LayerNorm) or
    RMSNorm (weight only)."""
    if mpt.norm_type == "rmsnorm":
        return RMSNorm(size, mpt.norm_eps)
    return nn.LayerNorm(size, eps=mpt.norm_eps, bias=not mpt.no_bias)


class MptAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        mpt = config.mpt
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = not mpt.no_bias
        # One fused linear (LoRA/PEFT target it as one module), split into q/k/v after it.
        self.Wqkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.out_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.clip_qkv = mpt.clip_qkv
        if mpt.qk_ln:  # over all heads at once, before the head split (MosaicML's q_ln / k_ln)
            self.q_ln = mpt_norm(mpt, self.q_size)
            self.k_ln = mpt_norm(mpt, self.kv_size)
        self.qk_ln = mpt.qk_ln
        slopes = alibi_slopes(self.num_heads, mpt.alibi_bias_max) if mpt.alibi else None
        self.attn = PagedAttention(
            layer_index, self.num_heads, self.num_kv_heads, self.head_dim, mpt.softmax_scale, alibi_slopes=slopes
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_ln:
            q, k = self.q_ln(q).to(x.dtype), self.k_ln(k).to(x.dtype)
        out = self.attn(
            q.reshape(rows, self.num_heads, self.head_dim),
            k.reshape(rows, self.num_kv_heads, self.head_dim),
            v.reshape(rows, self.num_kv_heads, self.head_dim),
        )
        return self.out_proj(out.reshape(rows, -1))


class MptMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = not config.mpt.no_bias
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))  # exact GELU, as MosaicML and transformers


class MptBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.norm_1 = mpt_norm(config.mpt, config.hidden_size)
        self.attn = MptAttention(config, layer_index)
        self.norm_2 = mpt_norm(config.mpt, config.hidden_size)
        self.ffn = MptMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.ffn(self.norm_2(x))


class MptModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MptBlock(config, i) for i in range(config.num_layers))
        self.norm_f = mpt_norm(config.mpt, config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.blocks:
            x = block(x)
        return self.norm_f(x)


class MptForCausalLM(nn.Module, ModelFamily):
    inputs = ModelInputs.TEXT

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.mpt is None:
            raise ValueError("MptForCausalLM needs a config normalised from an MPT config (config.mpt)")
        self.config = config
        self.transformer = MptModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.logit_scale = config.mpt.logit_scale

    @classmethod
    def config_for_checkpoint(cls, config: ModelConfig, names: set[str]) -> tuple[ModelConfig, str | None]:
        """transformers builds MPT without biases whatever `no_bias` says: a file that holds none loads without."""
        if config.mpt.no_bias or any(name.endswith(".bias") for name in names):
            return config, None
        return replace(config, attention_bias=False, mlp_bias=False, mpt=replace(config.mpt, no_bias=True)), (
            "config.json says no_bias: false but the checkpoint holds no biases: built without them, as "
            "transformers builds MPT")

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.transformer(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.logit_scale is None else logits * self.logit_scale


MPT_NORMS = {"layernorm": "layernorm", "low_precision_layernorm": "layernorm",
             "rmsnorm": "rmsnorm", "low_precision_rmsnorm": "rmsnorm"}


def mpt_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """MPT: transformers' MptConfig dict and MosaicML's config.json alike (`attn_config`, `ffn_config` nested
    dicts; keys a config omits take MosaicML's defaults, except `alibi`, which defaults to True as in
    transformers). Anything we cannot serve exactly is refused, naming the field."""
    attn = dict(hf.get("attn_config") or {})
    ffn = dict(hf.get("ffn_config") or {})
    d_model, n_heads = hf["d_model"], hf["n_heads"]
    alibi = bool(attn.get("alibi", True))

    require("learned_pos_emb", hf.get("learned_pos_emb"), alibi or not hf.get("learned_pos_emb", True),
            "learned positional embeddings without ALiBi are not supported")
    require("attn_config.prefix_lm", attn.get("prefix_lm"), not attn.get("prefix_lm"), "prefix-LM attention is not supported")
    require("attn_config.attn_uses_sequence_id", attn.get("attn_uses_sequence_id"),
            not attn.get("attn_uses_sequence_id"), "sequence-id attention masking is not supported")
    require("attn_config.rope", attn.get("rope"), not attn.get("rope"), "rotary embeddings in MPT are not supported")
    require("attn_config.qk_gn", attn.get("qk_gn"), not attn.get("qk_gn"), "q/k GroupNorm is not supported")
    window = attn.get("sliding_window_size", -1)
    require("attn_config.sliding_window_size", window, window in (-1, None), "sliding-window MPT is not supported")
    ffn_type = ffn.get("ffn_type", "mptmlp")
    require("ffn_config.ffn_type", ffn_type, ffn_type == "mptmlp", "supported: mptmlp (MoE and GLU FFNs are not)")
    act = ffn.get("ffn_act_fn")
    require("ffn_config.ffn_act_fn", act,
            act is None or (isinstance(act, dict) and act.get("name") == "gelu" and act.get("approximate", "none") == "none"),
            "supported: exact GELU")
    require("block_overrides", hf.get("block_overrides"), not hf.get("block_overrides"), "per-block overrides are not supported")
    require("d_model", d_model, d_model % n_heads == 0, f"not a multiple of n_heads {n_heads}")

    attn_type = attn.get("attn_type", "multihead_attention")
    if attn_type == "multihead_attention":
        kv_heads = n_heads
    elif attn_type == "multiquery_attention":
        kv_heads = 1
    elif attn_type == "grouped_query_attention":
        kv_heads = attn.get("kv_n_heads")
        require("attn_config.kv_n_heads", kv_heads,
                isinstance(kv_heads, int) and 0 < kv_heads <= n_heads and n_heads % kv_heads == 0,
                f"must divide n_heads {n_heads}")
    else:
        raise ValueError(f"unsupported attn_config.attn_type {attn_type!r}: supported: multihead_attention, "
                         "multiquery_attention, grouped_query_attention")
    norm_type = hf.get("norm_type", "low_precision_layernorm")
    require("norm_type", norm_type, norm_type in MPT_NORMS, f"supported: {', '.join(MPT_NORMS)}")
    head_dim = d_model // n_heads
    scale = attn.get("softmax_scale")
    logit_scale = hf.get("logit_scale")
    if logit_scale == "inv_sqrt_d_model":
        logit_scale = 1 / math.sqrt(d_model)
    require("logit_scale", logit_scale, logit_scale is None or isinstance(logit_scale, (int, float)),
            "a number or 'inv_sqrt_d_model'")
    clip = attn.get("clip_qkv")
    require("attn_config.clip_qkv", clip, clip is None or (isinstance(clip, (int, float)) and clip >= 0), "a number >= 0")
    # transformers' MptForCausalLM builds a 4 * d_model MLP whatever expansion_ratio says, so checkpoints it
    # saved (architectures names its class) have that shape; MosaicML's own code honours expansion_ratio.
    expansion = 4 if "MptForCausalLM" in (hf.get("architectures") or ()) else hf.get("expansion_ratio", 4)
    intermediate = ffn.get("ffn_hidden_size") or int(d_model * expansion)
    no_bias = bool(hf.get("no_bias", True))
    eos = hf.get("eos_token_id")
    return ModelConfig(
        model_type="mpt",
        vocab_size=hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=intermediate,
        num_layers=hf["n_layers"],
        num_heads=n_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("norm_eps", hf.get("layer_norm_epsilon", 1e-5))),
        max_position_embeddings=hf.get("max_seq_len", 2048),
        rope=RopeConfig(),  # unused: MPT has no rotary embeddings
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=not no_bias,
        mlp_bias=not no_bias,
        hidden_act="gelu",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        mpt=MptConfig(
            alibi=alibi,
            alibi_bias_max=float(attn.get("alibi_bias_max", 8)),
            clip_qkv=None if not clip else float(clip),
            qk_ln=bool(attn.get("qk_ln", False)),
            softmax_scale=float(scale) if scale is not None else 1 / math.sqrt(head_dim),
            no_bias=no_bias,
            norm_type=MPT_NORMS[norm_type],
            norm_eps=float(hf.get("norm_eps", hf.get("layer_norm_epsilon", 1e-5))),
            logit_scale=None if logit_scale is None else float(logit_scale),
        ),
    )
