"""The CLIP vision transformer (the vision tower of LLaVA-NeXT). Parameter names match transformers 5's
`CLIPVisionModel`: `embeddings.{class_embedding, patch_embedding, position_embedding}`, `pre_layrnorm`,
`encoder.layers.N.{self_attn.{q,k,v,out}_proj, layer_norm1, mlp.{fc1, fc2}, layer_norm2}`, `post_layernorm`.

Tiles in, hidden states out: `[tiles, 3, H, W] -> [tiles, 1 + patches, hidden]`. Every linear sees a
3-D `[tiles, tokens, features]` input, so a LoRA wrapper can tell whose tile each leading row is.
Attention is plain bidirectional attention within a tile (no KV cache, no forward context).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.models.config import VisionConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# The activations a vision config may name (also used by the LLaVA-NeXT projector).
VISION_ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        num_positions = (config.image_size // config.patch_size) ** 2 + 1  # patches + CLS
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tiles, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            side = self.image_size
            raise ValueError(f"tiles of {height}x{width} pixels; this vision tower takes {side}x{side}")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        cls = self.class_embedding.expand(tiles, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, size // config.num_heads
        self.q_proj = nn.Linear(size, size)
        self.k_proj = nn.Linear(size, size)
        self.v_proj = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [tiles, tokens, hidden] -> [tiles, heads, tokens, head_dim]
            return t.view(tiles, tokens, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(tiles, tokens, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = VISION_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_layers))


class CLIPVisionModel(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # sic: CLIP's name
        self.encoder = CLIPEncoder(config)
        # Only CLIP's pooled output reads it; LLaVA takes hidden states before it. Kept (and loaded) so
        # that every checkpoint tensor has its module.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """Hidden states `layers` (indices into the num_layers + 1 states, 0 being the embeddings after
        `pre_layrnorm`, negatives counting from the last layer's output) concatenated along features:
        `[tiles, 1 + patches, hidden * len(layers)]`. Layers past the deepest one asked for are skipped."""
        count = len(self.encoder.layers) + 1
        wanted = [i % count for i in layers]
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers[: max(wanted)]:
            x = layer(x)
            states.append(x)
        return torch.cat([states[i] for i in wanted], dim=-1)
