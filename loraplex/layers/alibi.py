"""ALiBi slopes (Press et al., 2021) as MosaicML's MPT computes them (`gen_slopes` in its attention.py;
transformers' `build_mpt_alibi_tensor` is the same formula).

Head h of n gets slope 1 / 2^((h + 1) * alibi_bias_max / n') with n' = n rounded up to a power of two; when
n is not a power of two, the odd-indexed slopes of the n' list come first, then the even-indexed ones,
truncated to n. The attention layer adds `slope[h] * (key_pos - query_pos)` to the scores: MPT adds
`slope[h] * (key_pos - last_key_pos)`, which differs by a constant per query row, so the softmax is the same.
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """[num_heads] float32 slopes, on the CPU (models are built on the meta device; this is no weight)."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    m = torch.arange(1, padded + 1, dtype=torch.float32, device="cpu") * (alibi_bias_max / padded)
    slopes = 1.0 / torch.pow(2, m)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes
