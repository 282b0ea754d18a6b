"""Which keys a query sees: the causal (and sliding-window) mask that the attention reference and the variable-length
kernel's probe share."""

from __future__ import annotations

import torch


def visible_keys(num_new: int, seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[num_new, seq_len] bool: which keys the last `num_new` positions of a sequence of `seq_len` see (those at or
    before each, at most `window` of them)."""
    q_pos = torch.arange(seq_len - num_new, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible
