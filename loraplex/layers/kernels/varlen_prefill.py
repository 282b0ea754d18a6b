"""Prefill self-attention in a launch or two per layer (CUDA): the variable-length FlashAttention-2 kernel that
PyTorch ships (`aten._flash_attention_forward` with cumulative sequence offsets), causal, with grouped-query heads
and sliding windows. One launch takes the step's fresh prompts (nothing cached before them: their keys are their
new rows); another the prompts resumed over cached context (a chunk after the first, a prefix-cache hit, draft
rows), whose keys are gathered from the cache, context first, and whose queries are their keys' last positions.

The torch reference (`TorchAttentionBackend._prefill`) calls SDPA once per sequence and layer: with a hundred
prompts starting in one step that was the largest host cost of the online benchmark (SDPA's per-call host
time, larger still with the mask resumed prompts need). Score biases (ALiBi, T5's
relative positions) stay on the reference path.

The kernel is a private ATen op, so whether it runs here is probed once per (device, dtype, head size, query heads
per KV head) with a tiny call; where it does not, every prompt takes the reference path. Resumed prompts need its
causal mask aligned to the end of the keys when a sequence has fewer queries than keys (FlashAttention 2.1 and
later); a second probe checks that against SDPA with an explicit mask, and keeps them on the reference otherwise.
"""

from __future__ import annotations

import functools

import torch

from loraplex.layers.masks import visible_keys  # the reference's mask

_DTYPES = (torch.float16, torch.bfloat16)


def causal_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_len_q: int, max_len_k: int, scale: float, sliding_window: int | None,
) -> torch.Tensor:
    """q [Tq, H, D], k and v [Tk, Hkv, D]: sequence i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q,
    its keys rows cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v (int32, on the device); its queries are its last
    positions (as many as it has) and attend causally (to at most the last `sliding_window` keys) -> [Tq, H, D]."""
    window = {} if sliding_window is None else {"window_size_left": sliding_window - 1, "window_size_right": 0}
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_len_q, max_len_k, 0.0, True, False, scale=scale, **window
    )[0]


def varlen_usable(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether `causal_varlen` runs for queries like `q` [T, H, D] here."""
    if not q.is_cuda or q.dtype not in _DTYPES or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return _probe(q.device, q.dtype, q.shape[-1], q.shape[1] // num_kv_heads)


def resumed_varlen_usable(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether `causal_varlen` runs for queries like `q` here with fewer queries than keys, as resumed prompts need."""
    return varlen_usable(q, num_kv_heads) and _aligned_to_the_end(q.device, q.dtype, q.shape[-1],
                                                                 q.shape[1] // num_kv_heads)


@functools.cache
def _probe(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    q = torch.zeros(4, group, head_dim, device=device, dtype=dtype)
    k = torch.zeros(4, 1, head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    try:
        causal_varlen(q, k, k, cu, cu, 3, 3, 1.0, None)
        causal_varlen(q, k, k, cu, cu, 3, 3, 1.0, 2)
    except (RuntimeError, TypeError):  # no flash kernel for this device, dtype or head size; an older signature
        return False
    return True


@functools.cache
def _aligned_to_the_end(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernel's causal mask (and sliding window) puts each sequence's queries at the end of its keys: two
    sequences of 1 query over 4 keys and 3 over 5, against SDPA with that mask written out (float32, from the same
    rounded values), without a window and with one of 2 keys."""
    g = torch.Generator(device=device).manual_seed(0)
    lens_q, lens_k = (1, 3), (4, 5)
    q = torch.randn(sum(lens_q), group, head_dim, generator=g, device=device).to(dtype)
    k, v = (torch.randn(sum(lens_k), 1, head_dim, generator=g, device=device).to(dtype) for _ in range(2))
    cu_q = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    for window in (None, 2):
        try:
            got = causal_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), head_dim**-0.5, window).float()
        except (RuntimeError, TypeError):
            return False
        for i, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
            rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            visible = visible_keys(n_q, n_k, window, device)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[rows].float().transpose(0, 1)[None], k[keys].float().transpose(0, 1)[None],
                v[keys].float().transpose(0, 1)[None], attn_mask=visible, scale=head_dim**-0.5, enable_gqa=True)
            if not torch.allclose(got[rows], expected[0].transpose(0, 1), atol=5e-2, rtol=5e-2):
                return False
    return True
