"""Fresh prompts' self-attention in one launch per layer (CUDA): the variable-length FlashAttention-2 kernel that
PyTorch ships (`aten._flash_attention_forward` with cumulative sequence offsets), causal, with grouped-query heads
and sliding windows, over the step's new rows of every prompt that has nothing cached before it.

The torch reference (`TorchAttentionBackend._prefill`) calls SDPA once per sequence and layer: with a hundred
prompts starting in one step that was the largest host cost of the online benchmark (on the H200 SDPA picked
cuDNN, ~330 us of host time a call). Score biases (ALiBi, T5's relative positions) and prompts resumed over
cached context stay on the reference path.

The kernel is a private ATen op, so whether it runs here is probed once per (device, dtype, head size, query heads
per KV head) with a tiny call; where it does not, every prompt takes the reference path.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = (torch.float16, torch.bfloat16)


def causal_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, Hkv, D]: sequence i owns rows cu_seqlens[i]:cu_seqlens[i + 1] (int32, on the
    device) and attends causally within itself (to at most the last `sliding_window` keys) -> [T, H, D]."""
    window = {} if sliding_window is None else {"window_size_left": sliding_window - 1, "window_size_right": 0}
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale, **window
    )[0]


def varlen_usable(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether `causal_varlen` runs for queries like `q` [T, H, D] here."""
    if not q.is_cuda or q.dtype not in _DTYPES or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return _probe(q.device, q.dtype, q.shape[-1], q.shape[1] // num_kv_heads)


@functools.cache
def _probe(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    q = torch.zeros(4, group, head_dim, device=device, dtype=dtype)
    k = torch.zeros(4, 1, head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    try:
        causal_varlen(q, k, k, cu, 3, 1.0, None)
        causal_varlen(q, k, k, cu, 3, 1.0, 2)
    except (RuntimeError, TypeError):  # no flash kernel for this device, dtype or head size; an older signature
        return False
    return True
