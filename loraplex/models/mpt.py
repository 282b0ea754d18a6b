"""MPT (MosaicML): pre-norm blocks with a fused Wqkv, ALiBi instead of rotary positions, a GELU MLP and
(by default) no biases and tied embeddings. Variants: multi-query / grouped-query attention, qkv clipping,
q/k LayerNorm, RMSNorm, biases (`no_bias` false) and logit scaling. Parameter names match transformers'
MptForCausalLM (and MosaicML's checkpoints, which use the same names).

The model runs on flat token rows: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`.
ALiBi is a score modifier of the paged attention layer, from absolute positions kept in the KV cache's
order, so `positions` is not read here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.config import ModelConfig, MptConfig
from loraplex.layers.alibi import alibi_slopes
from loraplex.layers.attention import PagedAttention
from loraplex.layers.norms import RMSNorm
from loraplex.models.base import ModelFamily, ModelInputs


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

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.transformer(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.logit_scale is None else logits * self.logit_scale
