"""A step's new keys and values written into the paged KV cache in one launch: what the reference's two
`index_copy_` calls do (`TorchAttentionBackend._write_kv`), in a decode step captured in a CUDA graph and in eager
steps (`fused_kernels_wanted`), where each launch saved is a few microseconds of every layer
(tests/gpu/test_gpu_elementwise.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slots_ptr, key_cache_ptr, value_cache_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, HEADS: tl.constexpr, DIM: tl.constexpr, HEADS_P: tl.constexpr, DIM_P: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, DIM_P)[None, :]
    ok = (heads < HEADS) & (dims < DIM)
    cached = slot * (HEADS * DIM) + heads * DIM + dims  # the cache is dense: [slots, heads, dim]
    k = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=ok)
    tl.store(key_cache_ptr + cached, k, mask=ok)
    v = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=ok)
    tl.store(value_cache_ptr + cached, v, mask=ok)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """key_cache/value_cache [num_blocks, block_size, Hkv, D] (dense) at flat slots[i] <- k[i], v[i] ([T, Hkv, D])."""
    rows, heads, dim = k.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and k.stride(2) == 1 and v.stride(2) == 1
    assert key_cache.shape[2:] == (heads, dim) and v.shape == k.shape and k.dtype == v.dtype == key_cache.dtype
    _write_kv[(rows,)](k, v, slots, key_cache, value_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                       HEADS=heads, DIM=dim, HEADS_P=triton.next_power_of_2(heads), DIM_P=triton.next_power_of_2(dim))


_write_kv = Launcher(_write_kv_kernel)  # every layer of an eager step: launched directly (launch.py)
