"""A step's new keys and values written into the paged KV cache in one launch: what the reference's two
`index_copy_` calls do (`TorchAttentionBackend._write_kv`), in a decode step captured in a CUDA graph and in eager
steps (`fused_kernels_wanted`), where each launch saved is a few microseconds of every layer
(tests/gpu/test_gpu_elementwise.py). Into an FP8 cache it writes what `kv_quant.quantize` does: x / scale (per KV
head, float32, correctly rounded), saturated, rounded to nearest even (tests/gpu/test_gpu_kv_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.layers.kv_quant import FP8_KV_DTYPE, FP8_MAX


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slots_ptr, key_cache_ptr, value_cache_ptr, kv_scales_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, HEADS: tl.constexpr, DIM: tl.constexpr, HEADS_P: tl.constexpr,
                     DIM_P: tl.constexpr, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, DIM_P)[None, :]
    ok = (heads < HEADS) & (dims < DIM)
    cached = slot * (HEADS * DIM) + heads * DIM + dims  # the cache is dense: [slots, heads, dim]
    k = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=ok)
    if FP8:  # kv_scales [2, HEADS]: the keys' row, then the values' (loaded as wide as k: div_rn does not broadcast)
        k = _to_fp8(k, tl.load(kv_scales_ptr + heads + 0 * dims, mask=ok, other=1.0), FP8_LIMIT)
        v = _to_fp8(v, tl.load(kv_scales_ptr + HEADS + heads + 0 * dims, mask=ok, other=1.0), FP8_LIMIT)
    tl.store(key_cache_ptr + cached, k, mask=ok)
    tl.store(value_cache_ptr + cached, v, mask=ok)


@triton.jit
def _to_fp8(x, scale, LIMIT: tl.constexpr):
    scaled = tl.math.div_rn(x.to(tl.float32), scale)
    scaled = tl.minimum(tl.maximum(scaled, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                        propagate_nan=tl.PropagateNan.ALL)
    return scaled.to(tl.float8e4nv, fp_downcast_rounding="rtne")


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """key_cache/value_cache [num_blocks, block_size, Hkv, D] (dense) at flat slots[i] <- k[i], v[i] ([T, Hkv, D]);
    an FP8 cache's values quantized with its `kv_scales` (float32 [2, Hkv])."""
    rows, heads, dim = k.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and k.stride(2) == 1 and v.stride(2) == 1
    fp8 = key_cache.dtype == FP8_KV_DTYPE
    assert key_cache.shape[2:] == (heads, dim) and v.shape == k.shape and k.dtype == v.dtype
    assert value_cache.dtype == key_cache.dtype == (FP8_KV_DTYPE if fp8 else k.dtype)
    assert fp8 == (kv_scales is not None) and (not fp8 or (kv_scales.shape == (2, heads) and kv_scales.is_contiguous()))
    _write_kv[(rows,)](k, v, slots, key_cache, value_cache, kv_scales if fp8 else slots, k.stride(0), k.stride(1),
                       v.stride(0), v.stride(1), HEADS=heads, DIM=dim, HEADS_P=triton.next_power_of_2(heads),
                       DIM_P=triton.next_power_of_2(dim), FP8=fp8, FP8_LIMIT=FP8_MAX)


_write_kv = Launcher(_write_kv_kernel)  # every layer of an eager step: launched directly (launch.py)
