"""T5 (v1.0, v1.1 / Flan-T5, mT5): an encoder of bidirectional blocks and a decoder whose blocks add
cross-attention to the encoder's output.

Parameter names match transformers' `T5ForConditionalGeneration` (PEFT names LoRA modules that way):
`shared`, `encoder.block.{i}.layer.{0: SelfAttention, 1: DenseReluDense}`, `decoder.block.{i}.layer.{0:
SelfAttention, 1: EncDecAttention, 2: DenseReluDense}`, each with its `layer_norm`, the stacks'
`final_layer_norm`, `lm_head`. T5 specifics: no score scaling; a relative position bias owned by each
stack's first block and added in every block (bidirectional buckets in the encoder, causal in the decoder;
none in cross-attention); RMS norms without mean or bias; v1.0 ties the head to the embedding and rescales
the decoder output by d_model^-0.5, v1.1 has its own head and a gated-GELU feed-forward.

In half precision transformers keeps every `wo` in float32 (`keep_in_float32`; the loader honours it):
the feed-forward output is then float32 and so is the residual stream it is added to.

Interface (docs/architecture.md, "Encoder-decoder models (T5, BART)"):
`encode(input_ids [E], positions [E]) -> [E, d_model]` for the step's encoder rows,
`forward(input_ids [T], positions [T], encoder_hidden=None) -> [T, d_model]` for decoder rows (cross K/V
computed from `encoder_hidden` for the requests whose encoder ran this step), `compute_logits`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.layers.rotary import RopeConfig
from loraplex.models.config import EncoderDecoderConfig, ModelConfig, T5Settings
from loraplex.layers.attention import PagedAttention
from loraplex.layers.encoder_attention import CrossAttention, EncoderAttention
from loraplex.layers.relative_position import RelativePositionBias
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.hf_config import require, token_id, token_ids

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class T5LayerNorm(nn.Module):
    """RMS norm in float32 statistics; cast to the weight's dtype when that is half precision (as T5)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class T5Attention(nn.Module):
    """q/k/v/o projections around one attention kind: the encoder's, the decoder's paged causal one, or
    cross-attention (k/v from the encoder output). `relative_attention_bias` only in a stack's first block."""

    def __init__(self, config: ModelConfig, kind: str, layer_index: int, bias: RelativePositionBias | None,
                 owns_bias: bool) -> None:
        super().__init__()
        t5 = config.t5
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        inner = self.num_heads * self.head_dim
        self.q = nn.Linear(config.hidden_size, inner, bias=False)
        self.k = nn.Linear(config.hidden_size, inner, bias=False)
        self.v = nn.Linear(config.hidden_size, inner, bias=False)
        self.o = nn.Linear(inner, config.hidden_size, bias=False)
        if owns_bias:
            self.relative_attention_bias = nn.Embedding(t5.num_buckets, self.num_heads)
        self.kind = kind
        h, d = self.num_heads, self.head_dim
        if kind == "encoder":
            self.attn = EncoderAttention(h, h, d, scale=1.0, position_bias=bias)
        elif kind == "decoder":
            self.attn = PagedAttention(layer_index, h, h, d, scale=1.0, position_bias=bias)
        else:
            self.attn = CrossAttention(layer_index, h, h, d, scale=1.0)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        q = self._heads(self.q(x))
        if self.kind == "cross":
            k = v = None
            if states is not None:
                k, v = self._heads(self.k(states)), self._heads(self.v(states))
            out = self.attn(q, k, v)
        else:
            out = self.attn(q, self._heads(self.k(x)), self._heads(self.v(x)))
        return self.o(out.reshape(x.shape[0], -1))


class T5DenseActDense(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.t5.feed_forward_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)).to(self.wo.weight.dtype))


class T5DenseGatedActDense(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.wi_1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.t5.feed_forward_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo((self.act(self.wi_0(x)) * self.wi_1(x)).to(self.wo.weight.dtype))


def _clamp_half(x: torch.Tensor) -> torch.Tensor:
    """float16 only: pull infinities back into range, as T5 does after each sub-layer."""
    if x.dtype != torch.float16:
        return x
    limit = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), limit - 1000, limit)
    return x.clamp(min=-limit, max=limit)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, layer_index: int, bias, owns_bias: bool) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(config, kind, layer_index, bias, owns_bias)
        self.layer_norm = T5LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _clamp_half(x + self.SelfAttention(self.layer_norm(x)))


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(config, "cross", layer_index, None, owns_bias=False)
        self.layer_norm = T5LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, encoder_hidden: torch.Tensor | None) -> torch.Tensor:
        return _clamp_half(x + self.EncDecAttention(self.layer_norm(x), encoder_hidden))


class T5LayerFF(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dense = T5DenseGatedActDense if config.t5.gated else T5DenseActDense
        self.DenseReluDense = dense(config)
        self.layer_norm = T5LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _clamp_half(x + self.DenseReluDense(self.layer_norm(x)))


class T5Block(nn.Module):
    def __init__(self, config: ModelConfig, decoder: bool, layer_index: int, bias: RelativePositionBias) -> None:
        super().__init__()
        kind = "decoder" if decoder else "encoder"
        layers: list[nn.Module] = [T5LayerSelfAttention(config, kind, layer_index, bias, owns_bias=layer_index == 0)]
        if decoder:
            layers.append(T5LayerCrossAttention(config, layer_index))
        layers.append(T5LayerFF(config))
        self.layer = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self.layer[0](x)
        if len(self.layer) == 3:
            x = self.layer[1](x, encoder_hidden)
        return self.layer[-1](x)


class T5Stack(nn.Module):
    def __init__(self, config: ModelConfig, embed_tokens: nn.Embedding, decoder: bool) -> None:
        super().__init__()
        t5 = config.t5
        num_layers = config.num_layers if decoder else config.encoder_decoder.num_encoder_layers
        self.embed_tokens = embed_tokens  # the shared embedding, under this stack's name too (older checkpoints)
        blocks: list[T5Block] = []
        bias: RelativePositionBias | None = None
        for i in range(num_layers):
            block = T5Block(config, decoder, i, bias)
            if i == 0:  # the first block owns the table; build the shared bias from it for the others
                table = block.layer[0].SelfAttention.relative_attention_bias
                bias = RelativePositionBias(table, not decoder, t5.num_buckets, t5.max_distance)
                attn = block.layer[0].SelfAttention.attn
                attn.position_bias = bias
            blocks.append(block)
        self.block = nn.ModuleList(blocks)
        self.final_layer_norm = T5LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.block:
            x = block(x, encoder_hidden)
        return self.final_layer_norm(x)


class T5ForConditionalGeneration(nn.Module, ModelFamily):
    inputs = ModelInputs.TEXT | ModelInputs.ENCODER
    linear_rows = (("decoder.*.EncDecAttention.k", "states"), ("decoder.*.EncDecAttention.v", "states"),
                   ("encoder.*", "encoder"))
    keep_in_float32 = ("wo",)  # module names whose weights stay float32 in half precision (transformers' list)
    keep_unquantized = ("wo",)  # and stay unquantized, as transformers' bitsandbytes loading does

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.t5 is None or config.encoder_decoder is None:
            raise ValueError("T5ForConditionalGeneration needs a config normalised from a T5 config")
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = T5Stack(config, self.shared, decoder=False)
        self.decoder = T5Stack(config, self.shared, decoder=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight
        self.output_scale = config.hidden_size**-0.5 if config.t5.scale_decoder_outputs else None

    @classmethod
    def config_for_checkpoint(cls, config: ModelConfig, names: set[str]) -> tuple[ModelConfig, str | None]:
        """transformers 5 always ties T5's head to the embedding: a file with no head of its own loads tied."""
        if config.tie_word_embeddings or "lm_head.weight" in names or "shared.weight" not in names:
            return config, None
        return replace(config, tie_word_embeddings=True), (
            "config.json says tie_word_embeddings: false but the checkpoint holds no lm_head.weight: the head is "
            "the embedding, as transformers 5 loads it")

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's encoder rows -> the encoder output (positions are implicit: T5's are relative)."""
        return self.encoder(input_ids)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.decoder(input_ids, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_scale is not None:
            hidden = hidden * self.output_scale
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))


# What feed_forward_proj may name (ACTIVATIONS holds their functions).
SUPPORTED_ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu")
# Relative positions have no learned limit; the engine's limits apply.
UNBOUNDED_POSITIONS = 1 << 30


def t5_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """T5 v1.0, v1.1 / Flan-T5 and mT5. The shared fields describe the decoder (its layers hold the KV cache)."""
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-") if isinstance(proj, str) else []
    require("feed_forward_proj", proj, len(parts) in (1, 2) and (len(parts) == 1 or parts[0] == "gated"),
            "expected ACT or gated-ACT")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # transformers reads "gated-gelu" as gelu_new
    require("feed_forward_proj", proj, act in SUPPORTED_ACTIVATIONS, f"supported activations: {', '.join(SUPPORTED_ACTIVATIONS)}")
    d_model, heads, d_kv = hf["d_model"], hf["num_heads"], hf["d_kv"]
    num_layers = hf.get("num_layers", 6)
    # transformers 5 saves `scale_decoder_outputs` and always `tie_word_embeddings: true`; older configs say
    # `tie_word_embeddings: false` for v1.1 (no rescale, own head).
    tie = hf.get("tie_word_embeddings", True) is not False
    # mT5 never rescales (transformers 5's MT5 has no rescale at all; its configs all said untied before).
    scale = hf.get("scale_decoder_outputs", tie) and hf.get("model_type") != "mt5"
    eos = hf.get("eos_token_id", 1)
    start = hf.get("decoder_start_token_id")
    start = hf.get("pad_token_id", 0) if start is None else start
    require("decoder_start_token_id", start, isinstance(start, int) and 0 <= start < hf["vocab_size"], "not a token id")
    return ModelConfig(
        model_type=hf.get("model_type", "t5"),
        vocab_size=hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=hf["d_ff"],
        num_layers=hf.get("num_decoder_layers") or num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d_kv,
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        max_position_embeddings=UNBOUNDED_POSITIONS,  # relative positions: no learned limit
        rope=RopeConfig(),  # unused
        tie_word_embeddings=tie,
        hidden_act=act,
        bos_token_id=None,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        encoder_decoder=EncoderDecoderConfig(
            num_encoder_layers=num_layers,
            decoder_start_token_id=start,
            forced_bos_token_id=token_id("forced_bos_token_id", hf.get("forced_bos_token_id"), hf["vocab_size"]),
            forced_eos_token_ids=token_ids("forced_eos_token_id", hf.get("forced_eos_token_id"), hf["vocab_size"]),
        ),
        t5=T5Settings(
            feed_forward_act=act,
            gated=len(parts) == 2,
            num_buckets=hf.get("relative_attention_num_buckets", 32),
            max_distance=hf.get("relative_attention_max_distance", 128),
            scale_decoder_outputs=bool(scale),
        ),
    )
