"""Memory sizing: how many KV cache blocks the engine makes, from the device's free memory and what else must fit."""

from __future__ import annotations

import logging
import os

import torch

from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.worker.decode_graphs import BATCH_SIZES as GRAPH_BATCH_SIZES
from loraplex.engine.scheduling.kv_cache import blocks_for
from loraplex.engine.loading import LoadedModel
from loraplex.layers.kv_quant import resolve_kv_cache_dtype

log = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 2 << 30


def kv_cache_dtype(cfg: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """What the KV cache stores (`--kv-cache-dtype`; KVCacheDtypeError where it cannot run)."""
    return resolve_kv_cache_dtype(cfg.kv_cache_dtype, loaded.dtype, loaded.device)


def apply_checkpoint_kv_scales(engine, loaded: LoadedModel) -> None:
    """A quantized checkpoint's calibrated KV-cache scales into the engine's FP8 cache; with another cache they
    have no use."""
    if not loaded.kv_scales:
        return
    if engine.kv_cache_dtype == torch.float8_e4m3fn:
        engine.set_kv_scales(loaded.kv_scales)
        log.info("FP8 KV cache: the checkpoint's scales for %d layers", len(loaded.kv_scales))
    else:
        log.warning("the checkpoint's KV-cache scales apply with --kv-cache-dtype fp8 only: not used")


def kv_bytes_per_token(mc: ModelConfig, kv_dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer (an FP8 cache: one byte each, its scales aside)."""
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * kv_dtype.itemsize


def kv_cache_blocks(cfg: EngineConfig, loaded: LoadedModel, kv_dtype: torch.dtype | None = None) -> int:
    """Blocks of a cache storing `kv_dtype` (default: the config's) in the memory budget."""
    if cfg.max_batch_total_tokens is not None:
        return blocks_for(cfg.max_batch_total_tokens, cfg.block_size)
    bytes_per_token = kv_bytes_per_token(loaded.config, kv_dtype or kv_cache_dtype(cfg, loaded))
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        free -= (1.0 - cfg.cuda_memory_fraction) * total  # the share of the device not ours
        budget = free * (cfg.kv_cache_memory_fraction or 0.85) - reserved_bytes(cfg, loaded, total)
    else:  # CPU: host memory is shared with everything else; a modest slice, capped
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(available * (cfg.kv_cache_memory_fraction or 0.1), CPU_KV_CACHE_CAP_BYTES)
        if cfg.kv_cache_memory_fraction is None:
            # and no more than the weights: a CPU computes few sequences at once, so a small model needs
            # little cache.
            budget = min(budget, sum(p.numel() * p.element_size() for p in loaded.model.parameters()))
    # At least one longest request.
    tokens = max(cfg.max_total_tokens, int(budget) // bytes_per_token)
    return blocks_for(tokens, cfg.block_size)


def reserved_bytes(cfg: EngineConfig, loaded: LoadedModel, total: int) -> int:
    """CUDA memory kept out of the KV cache: the adapters' slots (every linear at the largest rank, for every
    slot, at most `adapter_memory_fraction` of the device) and the decode graphs' activations and logits (at
    their largest batch, counted in float32 to be safe)."""
    mc = loaded.config
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    per_slot = sum(m.in_features + m.out_features for m in linears) * cfg.max_lora_rank * loaded.dtype.itemsize
    adapters = min(cfg.max_active_adapters * per_slot, int(cfg.adapter_memory_fraction * total))
    graphs = 0
    if cfg.cuda_graphs:
        row = mc.vocab_size + 4 * mc.intermediate_size + 8 * mc.hidden_size + 64 * mc.num_heads * mc.head_dim
        graphs = min(cfg.max_num_seqs, GRAPH_BATCH_SIZES[-1]) * row * 4
    return adapters + graphs
