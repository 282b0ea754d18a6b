"""Llama 3.2 Vision (Mllama): a Llama text model with gated cross-attention layers that read image states.

Parameter names are transformers 5's `MllamaForConditionalGeneration` (PEFT adapters name modules that
way): `model.vision_model.*` and `model.multi_modal_projector` (models/mllama_vision.py),
`model.language_model.{embed_tokens, layers.{i}, norm}`, `lm_head`. Layer i is a cross-attention layer
when i is in `cross_attention_layers`, else a Llama self-attention layer; both kinds count in the layer
list and each has its own KV cache (a cross layer's holds image states, in the request's state blocks).

Images never enter the token stream: `image_states` turns a request's tiles into states once, the cross
layers project them to keys/values at that step (`cross_states`), and later steps read them back. Which
states a row may see, and whether it sees any, is the step's business (layers/encoder_attention.py): a row
that sees none gets no output from a cross layer (its attention output is zero and its feed-forward output
dropped, transformers' `full_text_row_masked_out_mask`), and a step where no sequence has images skips
the cross layers altogether, as transformers' text-only path does.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from loraplex.models.config import MllamaSettings, ModelConfig
from loraplex.layers.encoder_attention import CrossAttention
from loraplex.layers.norms import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.hf_config import normalised, require
from loraplex.models.llama import LlamaDecoderLayer, LlamaMLP, llama_config_from_hf
from loraplex.models.mllama_vision import VISION_CHECKPOINT_RENAMES, MllamaImageEncoder, vision_config_from_hf

# Checkpoint name -> module name: transformers 4 (meta-llama's Llama-3.2-Vision) saves the text model as
# `language_model.model.*` and `language_model.lm_head`; transformers 5 names pass unchanged.
_CHECKPOINT_RENAMES = [
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    *VISION_CHECKPOINT_RENAMES,
]
EXTRA_EMBEDDINGS = 8  # Mllama's embedding has 8 rows past the head's vocabulary (the image token among them)


class MllamaTextCrossAttention(nn.Module):
    """q from the text rows, k/v from image states; q and k RMS-normed per head."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden = config.hidden_size
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=False)
        self.k_proj = nn.Linear(hidden, kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = CrossAttention(layer_index, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, states: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(rows, self.num_heads, self.head_dim))
        k = v = None
        if states is not None:  # states made this step: their keys/values are stored, then read like the rest
            k = self.k_norm(self.k_proj(states).view(-1, self.num_kv_heads, self.head_dim))
            v = self.v_proj(states).view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v).reshape(rows, -1))


class MllamaCrossAttentionDecoderLayer(nn.Module):
    """Pre-norm cross-attention and MLP, each residual branch scaled by tanh of its own gate."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn = MllamaTextCrossAttention(config, layer_index)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, states: torch.Tensor | None) -> torch.Tensor:
        attention = self.cross_attn.attn
        if attention.skipped():  # no sequence of the step has image states
            return x
        x = x + self.cross_attn_attn_gate.tanh() * self.cross_attn(self.input_layernorm(x), states)
        mlp = self.mlp(self.post_attention_layernorm(x))
        seeing = attention.rows_seeing_states()
        if seeing is not None:  # a fill, not a 0/1 multiply: nothing (not even a NaN) reaches those rows
            mlp = mlp.masked_fill(~seeing[:, None], 0.0)
        return x + self.cross_attn_mlp_gate.tanh() * mlp


class MllamaTextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cross = set(config.mllama.cross_attention_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size + EXTRA_EMBEDDINGS, config.hidden_size)
        self.layers = nn.ModuleList(
            MllamaCrossAttentionDecoderLayer(config, i) if i in cross else LlamaDecoderLayer(config, i)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cross_states: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cross_states) if isinstance(layer, MllamaCrossAttentionDecoderLayer) else layer(rope, x)
        return self.norm(x)


class MllamaModel(MllamaImageEncoder):
    """transformers' `MllamaModel`: the image encoder's parts plus `language_model`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.mllama.vision, config.hidden_size)
        self.language_model = MllamaTextModel(config)


class MllamaForConditionalGeneration(nn.Module, ModelFamily):
    inputs = ModelInputs.TEXT | ModelInputs.IMAGE_STATES
    linear_rows = (("model.vision_model.*", "patches"), ("model.multi_modal_projector", "patches"),
                   ("*.cross_attn.k_proj", "states"), ("*.cross_attn.v_proj", "states"))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.mllama is not None, "an mllama config has its cross-attention and vision settings"
        self.config = config
        self.model = MllamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The module name a checkpoint tensor fills (weights.load_into asks)."""
        for pattern, replacement in _CHECKPOINT_RENAMES:
            name = pattern.sub(replacement, name)
        return name

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers whose KV cache holds only image states (the runner gives them a block pool of their own)."""
        return self.config.mllama.cross_attention_layers

    @property
    def states_per_tile(self) -> int:
        """Image states each tile gives the cross-attention layers (patches + CLS)."""
        return self.config.mllama.vision.num_patches

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cross_states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`cross_states` [S, hidden]: image states made this step (`image_states` rows of the requests
        starting, as the step's attention metadata lays them out), or None when none starts."""
        return self.model.language_model(input_ids, positions, cross_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def image_states(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        """[images, tiles, C, H, W], [images], [images, tiles] -> states [images, tiles, states_per_tile,
        hidden]. Padding tiles go through the encoder too (real tiles attend to them there); their states
        are seen by no row."""
        images, tiles = pixel_values.shape[:2]
        states = self.model.encode_images(pixel_values[None], aspect_ratio_ids[None], aspect_ratio_mask[None])
        return states.view(images, tiles, self.states_per_tile, -1)


def mllama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Mllama: a Llama text model (`text_config`, its cross-attention layers counted in num_hidden_layers)
    and the vision encoder of `vision_config`."""
    from transformers import MllamaConfig  # configs only: it fills in the defaults

    try:
        full = MllamaConfig.from_dict(hf).to_dict()
    except Exception as e:
        raise ValueError(f"invalid mllama config: {e}") from e
    text = full["text_config"]
    layers, vocab = text["num_hidden_layers"], text["vocab_size"]
    cross = tuple(text.get("cross_attention_layers") or ())
    token = hf.get("image_token_index", full.get("image_token_index"))
    require("text_config.cross_attention_layers", cross,
            all(isinstance(i, int) and 0 <= i < layers for i in cross) and len(set(cross)) == len(cross),
            f"each must index the {layers} text layers once")
    require("image_token_index", token, isinstance(token, int) and vocab <= token < vocab + 8,
            f"the embedding's extra rows are ids {vocab}..{vocab + 7}")
    base = normalised(llama_config_from_hf, {**text, "model_type": "llama"})
    tie = hf["tie_word_embeddings"] if "tie_word_embeddings" in hf else base.tie_word_embeddings
    require("tie_word_embeddings", tie, not tie, "the embedding has 8 rows more than the head")
    return replace(
        base,
        model_type="mllama",
        tie_word_embeddings=False,
        mllama=MllamaSettings(tuple(sorted(cross)), token, vision_config_from_hf(full["vision_config"])),
    )
