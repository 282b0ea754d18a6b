"""T5's relative position bias: a learned scalar per head for each bucket of key-query distance.

Distances are bucketed as T5 does: exact for small distances, logarithmic up to `max_distance`, one bucket
beyond. The encoder's buckets are bidirectional (half the buckets for keys after the query); the decoder's
are causal (only keys at or before the query). Only the first layer of a stack owns the table; every layer
of the stack adds the same bias, so the table is passed to each attention layer by reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(
    distance: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket index of each `key_pos - query_pos` (int64, any shape)."""
    buckets = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        buckets += (distance > 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = (-distance).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # The float log of 0 is -inf; those rows are small and take the exact branch.
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias:
    """`bias(distance) -> [..., heads]` float32 from a stack's table (an nn.Embedding [buckets, heads]).

    A plain object, not a module: the table is a parameter of the layer that owns it (so checkpoint names
    stay T5's); attention layers of the whole stack hold this reference to it.
    """

    def __init__(self, table: nn.Embedding, bidirectional: bool, num_buckets: int, max_distance: int) -> None:
        self.table = table
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        self.max_distance = max_distance

    def __call__(self, distance: torch.Tensor) -> torch.Tensor:
        buckets = relative_position_bucket(distance, self.bidirectional, self.num_buckets, self.max_distance)
        return self.table(buckets).float()
