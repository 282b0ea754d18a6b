"""BART and mBART: an encoder of bidirectional layers and a decoder whose layers add cross-attention to the
encoder's output; learned absolute positions in both.

Parameter names match transformers' `BartForConditionalGeneration` / `MBartForConditionalGeneration` (PEFT
names LoRA modules that way): `model.shared`, `model.{encoder,decoder}.{embed_tokens, embed_positions,
layernorm_embedding}`, `model.encoder.layers.{i}.{self_attn.{q,k,v,out}_proj, self_attn_layer_norm, fc1, fc2,
final_layer_norm}`, the same in `model.decoder.layers.{i}` plus `encoder_attn.*` and `encoder_attn_layer_norm`,
mBART's `model.{encoder,decoder}.layer_norm`, `lm_head` and the buffer `final_logits_bias` [1, vocab].

BART specifics: token embeddings times sqrt(d_model) when `scale_embedding`; position p reads row p + 2 of
`embed_positions` (fairseq's offset); a LayerNorm after the embeddings; scores scaled by head_dim^-0.5;
encoder and decoder may have different head counts and feed-forward widths (cross-attention uses the
decoder's heads). BART's layers are post-norm (norm after each residual add); mBART's are pre-norm, with a
final LayerNorm after each stack. The encoder's and decoder's `embed_tokens` are `model.shared` (checkpoints
hold them under any of those names, or only one); the head is tied to it unless `tie_word_embeddings` is
false, and an untied checkpoint that holds each stack's embeddings gives each stack its own, as transformers does. transformers' layers clamp float16 activations to the finite range; so do ours (BART's encoder
clamps only non-finite values; clamping always differs only within 1000 of float16's maximum).

Interface (docs/architecture.md, "Encoder-decoder models (T5, BART)"):
`encode(input_ids [E], positions [E]) -> [E, d_model]` for the step's encoder rows,
`forward(input_ids [T], positions [T], encoder_hidden=None) -> [T, d_model]` for decoder rows (cross K/V
computed from `encoder_hidden` for the requests whose encoder ran this step), `compute_logits`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from loraplex.layers.rotary import RopeConfig
from loraplex.models.config import BartSettings, EncoderDecoderConfig, ModelConfig
from loraplex.layers.attention import PagedAttention
from loraplex.layers.encoder_attention import CrossAttention, EncoderAttention
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.hf_config import require, token_id, token_ids
from loraplex.models.t5 import ACTIVATIONS

BART_ACTIVATIONS = {**ACTIVATIONS, "tanh": torch.tanh}
POSITION_OFFSET = 2  # position p reads row p + 2 of embed_positions


def _clamp_half(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float16:
        return x
    limit = torch.finfo(torch.float16).max - 1000
    return x.clamp(min=-limit, max=limit)


class BartAttention(nn.Module):
    """q/k/v/out projections (with biases) around one attention kind: "encoder" (bidirectional), "decoder"
    (paged causal self-attention) or "cross" (k/v from the encoder output, stored at the encoder's step)."""

    def __init__(self, d_model: int, num_heads: int, kind: str, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.kind = kind
        h, d, scale = num_heads, self.head_dim, self.head_dim**-0.5
        if kind == "encoder":
            self.attn = EncoderAttention(h, h, d, scale)
        elif kind == "decoder":
            self.attn = PagedAttention(layer_index, h, h, d, scale)
        else:
            self.attn = CrossAttention(layer_index, h, h, d, scale)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        q = self._heads(self.q_proj(x))
        if self.kind == "cross":
            k = v = None
            if states is not None:
                k, v = self._heads(self.k_proj(states)), self._heads(self.v_proj(states))
            out = self.attn(q, k, v)
        else:
            out = self.attn(q, self._heads(self.k_proj(x)), self._heads(self.v_proj(x)))
        return self.out_proj(out.reshape(x.shape[0], -1))


class BartLayer(nn.Module):
    """One encoder layer (self-attention, feed-forward) or decoder layer (causal self-attention,
    cross-attention, feed-forward); each sub-layer post-norm (BART) or pre-norm (mBART)."""

    def __init__(self, config: ModelConfig, decoder: bool, layer_index: int) -> None:
        super().__init__()
        bart, d = config.bart, config.hidden_size
        heads = config.num_heads if decoder else bart.encoder_attention_heads
        ffn = config.intermediate_size if decoder else bart.encoder_ffn_dim
        eps = config.rms_norm_eps
        self.self_attn = BartAttention(d, heads, "decoder" if decoder else "encoder", layer_index)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        if decoder:
            self.encoder_attn = BartAttention(d, heads, "cross", layer_index)
            self.encoder_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)
        self.act = BART_ACTIVATIONS[bart.activation]
        self.pre_norm = bart.normalize_before
        self.decoder = decoder

    def _residual(self, x: torch.Tensor, norm: nn.LayerNorm, fn: Callable) -> torch.Tensor:
        return x + fn(norm(x)) if self.pre_norm else norm(x + fn(x))

    def forward(self, x: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self._residual(x, self.self_attn_layer_norm, self.self_attn)
        if self.decoder:
            x = self._residual(x, self.encoder_attn_layer_norm, lambda h: self.encoder_attn(h, encoder_hidden))
        x = self._residual(x, self.final_layer_norm, lambda h: self.fc2(self.act(self.fc1(h))))
        return x if self.decoder else _clamp_half(x)


class BartStack(nn.Module):
    """The encoder or the decoder: scaled token embeddings plus learned positions, a LayerNorm, the layers,
    and (mBART) a final LayerNorm."""

    def __init__(self, config: ModelConfig, embed_tokens: nn.Embedding, decoder: bool) -> None:
        super().__init__()
        bart, d = config.bart, config.hidden_size
        num_layers = config.num_layers if decoder else config.encoder_decoder.num_encoder_layers
        self.embed_tokens = embed_tokens  # the shared embedding, under this stack's name too
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.layernorm_embedding = nn.LayerNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(BartLayer(config, decoder, i) for i in range(num_layers))
        if bart.add_final_layer_norm:
            self.layer_norm = nn.LayerNorm(d, eps=config.rms_norm_eps)
        self.embed_scale = math.sqrt(d) if bart.scale_embedding else 1.0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale + self.embed_positions(positions + POSITION_OFFSET)
        x = self.layernorm_embedding(x)
        for layer in self.layers:
            x = layer(x, encoder_hidden)
        return self.layer_norm(x) if hasattr(self, "layer_norm") else x


class BartModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        own = config.bart.stack_embeddings  # each stack its own table (untied checkpoints), else the shared one
        self.encoder = BartStack(config, nn.Embedding(config.vocab_size, config.hidden_size) if own else self.shared,
                                 decoder=False)
        self.decoder = BartStack(config, nn.Embedding(config.vocab_size, config.hidden_size) if own else self.shared,
                                 decoder=True)


class BartForConditionalGeneration(nn.Module, ModelFamily):
    inputs = ModelInputs.TEXT | ModelInputs.ENCODER
    linear_rows = (("model.decoder.*.encoder_attn.k_proj", "states"), ("model.decoder.*.encoder_attn.v_proj", "states"),
                   ("model.encoder.*", "encoder"))
    optional_checkpoint_tensors = ("final_logits_bias",)  # zeros when absent, as transformers leaves it
    unused_checkpoint_tensors = (r"^model\.(encoder|decoder)\.version$",)  # fairseq-era keys

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.bart is None or config.encoder_decoder is None:
            raise ValueError("BartForConditionalGeneration needs a config normalised from a BART or mBART config")
        self.config = config
        self.model = BartModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.shared.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))

    @classmethod
    def config_for_checkpoint(cls, config: ModelConfig, names: set[str]) -> tuple[ModelConfig, str | None]:
        """An untied checkpoint holding each stack's token embeddings: each stack reads its own, as transformers'
        untied BART does (its `model.shared` then feeds nothing but may still be saved)."""
        stacks = {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
        if config.tie_word_embeddings or not stacks <= names:
            return config, None
        return replace(config, bart=replace(config.bart, stack_embeddings=True)), None

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step's encoder rows (positions 0.. within each request) -> the encoder output."""
        return self.model.encoder(input_ids, positions)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the stacks take them (scaled; positions not added), as transformers'
        `get_input_embeddings()`."""
        return self.model.decoder.embed_tokens(input_ids) * self.model.decoder.embed_scale

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) + self.final_logits_bias


# What activation_function may name (BART_ACTIVATIONS holds their functions).
SUPPORTED_ACTIVATIONS = ("gelu", "relu", "gelu_new", "silu", "tanh")


def bart_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """BART and mBART (mBART: pre-norm layers and final layer norms). Shared fields describe the decoder."""
    model_type = hf.get("model_type", "bart")
    d_model = hf.get("d_model", 1024)
    heads = hf.get("decoder_attention_heads", 16)
    enc_heads = hf.get("encoder_attention_heads", 16)
    act = hf.get("activation_function", "gelu")
    require("activation_function", act, act in SUPPORTED_ACTIVATIONS, f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    require("decoder_attention_heads", heads, d_model % heads == 0, f"does not divide d_model {d_model}")
    require("encoder_attention_heads", enc_heads, d_model % enc_heads == 0, f"does not divide d_model {d_model}")
    mbart = model_type == "mbart"
    eos = hf.get("eos_token_id", 2)
    # mBART's config has none (transformers' generate then starts from bos_token_id); BART's default is 2.
    start = hf.get("decoder_start_token_id", None if mbart else 2)
    start = hf.get("bos_token_id", 0) if start is None else start
    require("decoder_start_token_id", start, isinstance(start, int) and 0 <= start < hf["vocab_size"], "not a token id")
    positions = hf.get("max_position_embeddings", 1024)
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=hf.get("decoder_ffn_dim", 4096),
        num_layers=hf.get("decoder_layers", 12),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d_model // heads,
        rms_norm_eps=1e-5,  # nn.LayerNorm's default, which BART uses
        max_position_embeddings=positions,
        rope=RopeConfig(),  # unused
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_act=act,
        bos_token_id=hf.get("bos_token_id", 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        encoder_decoder=EncoderDecoderConfig(
            num_encoder_layers=hf.get("encoder_layers", 12),
            decoder_start_token_id=start,
            max_source_positions=positions,
            forced_bos_token_id=token_id("forced_bos_token_id", hf.get("forced_bos_token_id"), hf["vocab_size"]),
            forced_eos_token_ids=token_ids("forced_eos_token_id", hf.get("forced_eos_token_id", 2), hf["vocab_size"]),
        ),
        bart=BartSettings(
            activation=act,
            scale_embedding=bool(hf.get("scale_embedding", False)),
            # transformers decides by model_type alone: BART configs' fairseq keys (normalize_before,
            # add_final_layer_norm, normalize_embedding ...) are ignored, mBART is always pre-norm.
            normalize_before=mbart,
            add_final_layer_norm=mbart,
            layernorm_embedding=True,
            encoder_ffn_dim=hf.get("encoder_ffn_dim", 4096),
            encoder_attention_heads=enc_heads,
        ),
    )
