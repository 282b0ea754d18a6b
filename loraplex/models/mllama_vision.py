"""The Llama 3.2 Vision (Mllama) image encoder: transformers 5's `MllamaVisionModel` and the
`multi_modal_projector` Linear, with transformers' parameter names.

`MllamaImageEncoder` holds `vision_model` and `multi_modal_projector` the way `MllamaModel` does, so a
full model whose `model` subclasses it (adding `language_model`) names its tensors
`model.vision_model.*` and `model.multi_modal_projector.*` as transformers and PEFT do.

Per image: its tiles are cut into patches, a CLS token is prepended per tile, and learned embeddings
chosen by the image's aspect ratio id (1 + index into supported_aspect_ratios; 0 = padding image) are
added. Each tile's tokens are padded to a multiple of 8, then all tiles of an image attend to each
other: first the local `transformer` (some of whose layer outputs are kept), then the tanh-gated
`global_transformer`. Output: the final states and the kept ones along features (vision_output_dim).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.models.config import MllamaVisionSettings
from loraplex.models.clip import VISION_ACTIVATIONS

# Checkpoint name -> module name, for the full model's `checkpoint_name`: checkpoints saved by
# transformers 4 (meta-llama's Llama-3.2-Vision) keep these at the top level.
VISION_CHECKPOINT_RENAMES = [(re.compile(r"^(vision_model|multi_modal_projector)\."), r"model.\1.")]


def vision_config_from_hf(hf: dict[str, Any]) -> MllamaVisionSettings:
    """transformers' MllamaVisionConfig (as a dict; omitted keys take its defaults) -> our settings."""
    image_size = hf.get("image_size", 448)
    if isinstance(image_size, (list, tuple)):
        if len(set(image_size)) != 1:
            raise ValueError(f"vision_config.image_size {image_size}: only square tiles are supported")
        image_size = image_size[0]
    layers, hidden = hf.get("num_hidden_layers", 32), hf.get("hidden_size", 1280)
    heads = hf.get("attention_heads", hf.get("num_attention_heads", 16))
    indices = tuple(hf.get("intermediate_layers_indices") or (3, 7, 15, 23, 30))
    ratios = hf.get("supported_aspect_ratios") or [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
    settings = MllamaVisionSettings(
        hidden_size=hidden, intermediate_size=hf.get("intermediate_size", 5120), num_layers=layers,
        num_global_layers=hf.get("num_global_layers", 8), num_heads=heads, image_size=image_size,
        patch_size=hf.get("patch_size", 14), num_channels=hf.get("num_channels", 3),
        max_num_tiles=hf.get("max_num_tiles", 4), num_aspect_ratios=len(ratios), intermediate_layers_indices=indices,
        norm_eps=float(hf.get("norm_eps", 1e-5)), hidden_act=hf.get("hidden_act", "gelu"),
        vision_output_dim=hf.get("vision_output_dim", 7680),
    )
    problems = {
        "image_size": (image_size % settings.patch_size == 0, f"not a multiple of patch_size {settings.patch_size}"),
        "attention_heads": (hidden % heads == 0, "does not divide hidden_size"),
        "hidden_act": (settings.hidden_act in VISION_ACTIVATIONS, f"supported: {', '.join(VISION_ACTIVATIONS)}"),
        "intermediate_layers_indices": (bool(indices) and all(-layers <= i < layers for i in indices),
                                        f"each must index the {layers} local layers"),
        "vision_output_dim": (settings.vision_output_dim == hidden * (1 + len(indices)),
                              "must be hidden_size * (1 + len(intermediate_layers_indices))"),
    }
    for field, (ok, why) in problems.items():
        if not ok:
            raise ValueError(f"vision_config.{field} {hf.get(field)!r}: {why}")
    return settings


def tile_attention_mask(tile_mask: torch.Tensor, tokens: int, padded: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' `_prepare_aspect_ratio_attention_mask`, as an additive [media, 1, T*padded, T*padded]
    mask. A token is padding if its tile is (tile_mask 0) or it is one of a tile's pad tokens. The mask is
    an outer product, so only padding-to-padding pairs are masked: real tokens still attend padding ones
    (transformers' quirk, kept for parity). Every row keeps a real key: a tile's CLS and patches are real."""
    is_pad = (1 - tile_mask.to(dtype))[:, :, None].repeat(1, 1, padded)
    is_pad[:, :, tokens:] = 1
    is_pad = is_pad.flatten(1)
    return (is_pad[:, :, None] * is_pad[:, None, :] * torch.finfo(dtype).min).unsqueeze(1)


class MllamaPrecomputedAspectRatioEmbedding(nn.Module):
    """One tanh-gated vector per tile slot, chosen by aspect ratio id, added to every token of the tile."""

    def __init__(self, s: MllamaVisionSettings) -> None:
        super().__init__()
        self.max_num_tiles, self.hidden_size = s.max_num_tiles, s.hidden_size
        self.embedding = nn.Embedding(s.num_aspect_ratios + 1, s.max_num_tiles * s.hidden_size)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # x [media, tiles, tokens, hidden]
        return x + self.embedding(ids).reshape(-1, self.max_num_tiles, 1, self.hidden_size) * self.gate.tanh()


class MllamaPrecomputedPositionEmbedding(nn.Module):
    """Per-token positions, blended by one gate between a shared table (1 - tanh g) and a per-aspect-ratio,
    per-tile table (tanh g)."""

    def __init__(self, s: MllamaVisionSettings) -> None:
        super().__init__()
        self.max_num_tiles, self.num_patches, self.hidden_size = s.max_num_tiles, s.num_patches, s.hidden_size
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.empty(s.num_patches, s.hidden_size))
        self.tile_embedding = nn.Embedding(s.num_aspect_ratios + 1, s.max_num_tiles * s.num_patches * s.hidden_size)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # x [media, tiles, tokens, hidden]
        gate = self.gate.tanh()
        x = x + (1 - gate) * self.embedding
        tiles = self.tile_embedding(ids).reshape(-1, self.max_num_tiles, self.num_patches, self.hidden_size)
        return x + gate * tiles


class MllamaVisionAttention(nn.Module):
    def __init__(self, s: MllamaVisionSettings) -> None:
        super().__init__()
        size = s.hidden_size
        self.num_heads, self.head_dim = s.num_heads, size // s.num_heads
        self.q_proj = nn.Linear(size, size, bias=False)
        self.k_proj = nn.Linear(size, size, bias=False)
        self.v_proj = nn.Linear(size, size, bias=False)
        self.o_proj = nn.Linear(size, size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        media, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [media, tokens, hidden] -> [media, heads, tokens, head_dim]
            return t.view(media, tokens, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), mask)
        return self.o_proj(out.transpose(1, 2).reshape(media, tokens, -1))


class MllamaVisionMLP(nn.Module):
    def __init__(self, s: MllamaVisionSettings) -> None:
        super().__init__()
        self.fc1 = nn.Linear(s.hidden_size, s.intermediate_size)
        self.fc2 = nn.Linear(s.intermediate_size, s.hidden_size)
        self.act = VISION_ACTIVATIONS[s.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MllamaVisionEncoderLayer(nn.Module):
    """Pre-norm layer; in the global transformer each branch is scaled by tanh of its own gate."""

    def __init__(self, s: MllamaVisionSettings, is_gated: bool) -> None:
        super().__init__()
        self.is_gated = is_gated
        self.self_attn = MllamaVisionAttention(s)
        self.mlp = MllamaVisionMLP(s)
        self.input_layernorm = nn.LayerNorm(s.hidden_size, eps=s.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(s.hidden_size, eps=s.norm_eps)
        if is_gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), mask)
        x = x + (self.gate_attn.tanh() * attn if self.is_gated else attn)
        ffn = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * ffn if self.is_gated else ffn)


class MllamaVisionEncoder(nn.Module):
    def __init__(self, s: MllamaVisionSettings, num_layers: int, is_gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MllamaVisionEncoderLayer(s, is_gated) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, keep: tuple[int, ...] = ()) -> tuple[torch.Tensor, list]:
        """Final states, and the outputs of layers `keep` (in that order; negatives count from the end)."""
        count = len(self.layers)
        wanted = {i % count for i in keep}
        kept = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, mask)
            if i in wanted:  # keep only what is asked for: at full size each state is ~30 MB per image
                kept[i] = x
        return x, [kept[i % count] for i in keep]


class MllamaVisionModel(nn.Module):
    def __init__(self, s: MllamaVisionSettings) -> None:
        super().__init__()
        self.settings, self.num_patches = s, s.num_patches
        self.patch_embedding = nn.Conv2d(s.num_channels, s.hidden_size, s.patch_size, stride=s.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(s.hidden_size))
        self.gated_positional_embedding = MllamaPrecomputedPositionEmbedding(s)
        self.pre_tile_positional_embedding = MllamaPrecomputedAspectRatioEmbedding(s)
        self.post_tile_positional_embedding = MllamaPrecomputedAspectRatioEmbedding(s)
        self.layernorm_pre = nn.LayerNorm(s.hidden_size)  # sic: default eps 1e-5, not norm_eps, as transformers
        self.layernorm_post = nn.LayerNorm(s.hidden_size)
        self.transformer = MllamaVisionEncoder(s, s.num_layers, is_gated=False)
        self.global_transformer = MllamaVisionEncoder(s, s.num_global_layers, is_gated=True)

    def forward(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        """[batch, images, tiles, C, H, W], [batch, images], [batch, images, tiles] ->
        [batch, images, tiles, num_patches, vision_output_dim] (transformers' last_hidden_state)."""
        batch, images, tiles, channels, height, width = pixel_values.shape
        media, hidden = batch * images, self.settings.hidden_size
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.reshape(-1, channels, height, width).to(weight.device, weight.dtype))
        x = x.flatten(2).transpose(1, 2).reshape(media, tiles, -1, hidden)
        ids = aspect_ratio_ids.reshape(media).to(weight.device)
        x = self.pre_tile_positional_embedding(x, ids)
        x = torch.cat([self.class_embedding.expand(media, tiles, 1, hidden), x], dim=2)
        x = self.layernorm_pre(self.gated_positional_embedding(x, ids))

        # Each tile's tokens padded to a multiple of 8 (zeros), then an image's tiles form one sequence.
        tokens = x.shape[2]
        padded = tokens + (-tokens) % 8
        x = F.pad(x, (0, 0, 0, padded - tokens))
        mask = tile_attention_mask(aspect_ratio_mask.reshape(media, tiles).to(x.device), tokens, padded, x.dtype)
        keep = self.settings.intermediate_layers_indices
        x, kept = self.transformer(x.reshape(media, tiles * padded, hidden), mask, keep)
        x = self.post_tile_positional_embedding(self.layernorm_post(x).reshape(media, tiles, padded, hidden), ids)
        x, _ = self.global_transformer(x.reshape(media, tiles * padded, hidden), mask)

        # transformers stacks the kept states on a new last axis before flattening: features interleave
        # (feature d of every kept layer, then d + 1), they are not concatenated layer after layer.
        intermediate = torch.stack(kept, dim=-1).reshape(media, tiles, padded, -1)
        x = torch.cat([x.reshape(media, tiles, padded, hidden), intermediate], dim=-1)[:, :, :tokens]
        return x.reshape(batch, images, tiles, tokens, -1)


class MllamaImageEncoder(nn.Module):
    """`MllamaModel`'s image half. Mounted as a parent's `model` (or subclassed by it), its tensors are
    transformers' `model.vision_model.*` and `model.multi_modal_projector.*`."""

    def __init__(self, settings: MllamaVisionSettings, text_hidden_size: int) -> None:
        super().__init__()
        self.text_hidden_size = text_hidden_size
        self.vision_model = MllamaVisionModel(settings)
        self.multi_modal_projector = nn.Linear(settings.vision_output_dim, text_hidden_size)

    def encode_images(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        """transformers' `cross_attention_states`: [batch * images * tiles, num_patches, text_hidden], rows
        ordered batch, image, tile. The text model's cross-attention views it per sequence as
        [batch, images * tiles * num_patches, text_hidden]."""
        states = self.vision_model(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
        batch, images, tiles, tokens, features = states.shape
        # [images, tiles * tokens, features]: the projector sees one item per image, as the vision layers do
        # (per-image LoRA rows are counted in images).
        projected = self.multi_modal_projector(states.reshape(batch * images, tiles * tokens, features))
        return projected.reshape(-1, tokens, self.text_hidden_size)

    forward = encode_images
