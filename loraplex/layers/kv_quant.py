"""The paged KV cache in 8 bits (`--kv-cache-dtype fp8`): a layer's cache, how values are stored and read back, and
the per-layer scales.

An FP8 cache holds float8_e4m3fn keys and values, half the bytes of bfloat16, so twice the tokens fit. A stored
value is `x / scale` saturated to +-448 (e4m3's largest finite value) and rounded; a reader multiplies it by
`scale` back. Each layer has float32 scales for its keys and values, one per KV head ([2, Hkv]: per-tensor scales
are all equal): 1.0 unless a checkpoint's calibrated `k_scale`/`v_scale` are set (`set_kv_scales`). They are
tensors allocated with the cache and only ever updated in place, so CUDA graphs captured over the cache read the
current ones.

Every reader sees a key as the cache returns it: a prompt attending to its own new keys first rounds them as the
cache stores them (`kv_as_cached`), so a prompt computed at once, in chunks, or over a prefix-cache hit sees the same
keys.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch

from loraplex.config import KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class KVCacheDtypeError(ValueError):
    """A cache dtype this device or configuration cannot run: one line, said at start-up."""


class LayerKVCache(NamedTuple):
    """One attention layer's cache: keys and values [num_blocks, block_size, Hkv, D] and, for an FP8 cache, their
    float32 scales [2, Hkv] (row 0 the keys', row 1 the values'); None for a cache in the model's dtype."""

    keys: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor | None = None


def layer_cache(kv_cache: Sequence[torch.Tensor]) -> LayerKVCache:
    """A backend's cache object as a LayerKVCache (a plain (keys, values) pair has no scales)."""
    return kv_cache if isinstance(kv_cache, LayerKVCache) else LayerKVCache(*kv_cache)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-cache-dtype`: "auto" is the model's dtype; "fp8" e4m3, where the attention kernels can read it (the
    CPU's torch path everywhere; on CUDA, Triton's e4m3 needs compute capability 8.9: Ada, Hopper and newer)."""
    if name == "auto":
        return model_dtype
    if name != "fp8":
        raise KVCacheDtypeError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise KVCacheDtypeError(
                f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    elif device.type != "cpu":
        raise KVCacheDtypeError(f"--kv-cache-dtype fp8 runs on CUDA and CPU, not on {device.type}")
    return FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] as the cache stores it: x / scale [Hkv] (float32), saturated, rounded to e4m3."""
    scaled = x.to(torch.float32) / scale[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 values [..., Hkv, D] read back in `dtype`: times scale [Hkv], in float32, then rounded."""
    return (stored.to(torch.float32) * scale[:, None]).to(dtype)


def kv_as_cached(k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """New keys and values as a reader of the cache gets them back (themselves for a cache in the model's dtype)."""
    if scales is None:
        return k, v
    return (dequantize(quantize(k, scales[0]), scales[0], k.dtype),
            dequantize(quantize(v, scales[1]), scales[1], v.dtype))


def read_kv(keys: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None,
            dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values read from the cache, in `dtype` (as they are for a cache in the model's dtype)."""
    if scales is None:
        return keys, values
    return dequantize(keys, scales[0], dtype), dequantize(values, scales[1], dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A view the index ops take for any dtype (the CPU's index_copy_/index_fill_ have no float8 kernels)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def set_kv_scales(kv_caches: Sequence[LayerKVCache], scales: Mapping[int, tuple]) -> None:
    """{layer index: (k_scale, v_scale)}: each a positive finite float, or a float32 tensor of one value or one per
    KV head (a checkpoint's `self_attn.k_scale` / `v_scale`). Copied into the layers' scale tensors in place
    (graphs already captured read them); layers not named keep theirs. Only an FP8 cache has scales. Set them before
    serving: blocks already written (prefix-cached ones too) hold values stored with the old scales."""
    for index, (k_scale, v_scale) in scales.items():
        if not 0 <= index < len(kv_caches):
            raise ValueError(f"KV scales for layer {index}: the model has {len(kv_caches)} attention layers")
        target = layer_cache(kv_caches[index]).scales
        if target is None:
            raise ValueError(f"KV scales for layer {index}, but its cache is {kv_caches[index][0].dtype}, not fp8")
        for row, value in enumerate((k_scale, v_scale)):
            values = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
            if values.numel() not in (1, target.shape[1]):
                raise ValueError(f"layer {index}: {values.numel()} scales for {target.shape[1]} KV heads")
            if not all(math.isfinite(s) and s > 0 for s in values.tolist()):
                raise ValueError(f"layer {index}: KV scales must be positive and finite, got {values.tolist()}")
            target[row].copy_(values.expand(target.shape[1]))
