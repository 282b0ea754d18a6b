"""The attention kinds of encoder-decoder models: the encoder's bidirectional attention and the decoder's
cross-attention. Both are computed by the step's attention backend (layers/attention.py)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from loraplex.layers.forward_context import get_forward_context


class EncoderAttention(nn.Module):
    """q/k/v [E, H(kv), D] for the step's encoder rows -> [E, H, D]; each sequence sees all its own rows.

    `position_bias` (optional): `key_pos - query_pos` [...] -> float32 bias [..., H] (T5's buckets).
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        position_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.position_bias = position_bias

    @property
    def has_score_bias(self) -> bool:
        return self.position_bias is not None

    def score_bias(self, distance: torch.Tensor) -> torch.Tensor:
        return self.position_bias(distance)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        return ctx.backend.encoder_forward(self, q, k, v, ctx.attn_metadata)


class CrossAttention(nn.Module):
    """Token rows q [T, H, D] attend to their own request's cross-attention states -> [T, H, D] (an
    encoder-decoder's encoder output, a vision model's image states; see `EncoderMetadata`).

    `k`/`v` [E, Hkv, D]: keys/values of the states made this step, for the requests that start (None when
    none does); they are stored in layer `layer_index`'s cache and read back on every later step.
    """

    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_forward_context()
        return ctx.backend.cross_forward(self, q, k, v, ctx.kv_caches[self.layer_index], ctx.attn_metadata)

    @staticmethod
    def skipped() -> bool:
        """No sequence of the step has states: the layer has nothing to attend to."""
        return get_forward_context().attn_metadata.encoder is None

    @staticmethod
    def rows_seeing_states() -> torch.Tensor | None:
        """[T] bool: the rows that see at least one state (None: all do)."""
        return get_forward_context().attn_metadata.encoder.rows_seeing
