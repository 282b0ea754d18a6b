"""Paged-attention decode in Triton: each decode row's query attends to its sequence's keys and values where they
lie in the paged KV cache, block by block through its block table, with no gather into a padded copy.

One program per (decode row, KV head, split of the context). The query heads that share the KV head (GQA) are
computed together, padded to 16 rows: scores and weighted values are tensor-core dots over 64 keys (four
16-token blocks) at a time, exact float32 dots for float32 inputs; so each key and value block is read once per
row. The context is split across programs (flash-decoding) so that even a few rows keep the GPU reading; each
split keeps its own running softmax in float32 (online, as FlashAttention's) and the splits are merged after.
Score modifiers as `PagedAttention` defines them: a sliding window (keys more than `window` positions back are
hidden), a soft cap (Gemma 2) and ALiBi slopes (`slope[h] * (key_pos - query_pos)` added to the scaled scores). An FP8 cache
(layers/kv_quant.py) is read as e4m3 and widened to the query's dtype exactly; its per-KV-head scales, constant in a
program, multiply the scores (keys') and the output (values'), not every element. The torch backend's `_decode` is
the reference (tests/gpu/test_gpu_paged_decode.py, tests/gpu/test_gpu_kv_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher

NO_WINDOW = 1 << 30  # the window of a layer without one: longer than any sequence


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, slopes_ptr, kv_scales_ptr, acc_ptr, ml_ptr,
    scale, window, softcap, blocks_per_split,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * GROUP
    heads = kv_head * GROUP + tl.arange(0, GROUP_P)  # the query heads of this KV head, padded for the dots
    head_ok = tl.arange(0, GROUP_P) < GROUP
    dims = tl.arange(0, DIM_P)
    dim_ok = dims < HEAD_DIM
    tokens = tl.arange(0, TOKENS)  # several blocks' tokens per iteration

    seq_len = tl.load(seq_lens_ptr + row)
    query_pos = seq_len - 1
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if HAS_ALIBI:
        slopes = tl.load(slopes_ptr + heads, mask=head_ok, other=0.0)
    score_scale = scale
    if FP8 and not IEEE:  # float16 products over the float16-widened cache (q's values are far inside its range)
        q = q.to(tl.float16)
    if FP8:  # kv_scales [2, Hkv]: the keys' row, then the values'
        score_scale = scale * tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + tl.num_programs(1) + kv_head)

    first_key = tl.maximum(seq_len - window, 0)  # `window` is huge when there is none
    begin = tl.maximum(split * blocks_per_split * BLOCK_SIZE, first_key // TOKENS * TOKENS)
    end = tl.minimum((split + 1) * blocks_per_split * BLOCK_SIZE, seq_len)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    for start in range(begin, end, TOKENS):
        key_pos = start + tokens
        visible = (key_pos < seq_len) & (key_pos >= first_key)
        block = tl.load(block_tables_ptr + row * stride_tb + key_pos // BLOCK_SIZE, mask=visible, other=0)
        offsets = block[:, None] * stride_kb + (key_pos % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        kv_mask = visible[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if FP8:  # e4m3 widens to float16 in one instruction (to bfloat16 it takes several): q is float16 here too
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * score_scale  # [GROUP_P, TOKENS]
        else:
            scores = tl.dot(q, tl.trans(k)) * score_scale
        if SOFTCAP:  # softcap * tanh(scores / softcap), as tanh(x) = 1 - 2 / (exp(2x) + 1): saturates, never NaN
            scores = softcap * (1.0 - 2.0 / (tl.exp(scores * (2.0 / softcap)) + 1.0))
        if HAS_ALIBI:
            scores += slopes[:, None] * (key_pos - query_pos).to(tl.float32)[None, :]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * correction + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * correction[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if FP8:
        acc = acc * v_scale
    # This split's unnormalised output and its (max, sum): [rows, heads, splits, ...]; a split without keys
    # leaves m = -inf, l = 0, which the merge weighs by zero.
    part = (row * num_heads + heads) * num_splits + split
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(ml_ptr + part * 2, m, mask=head_ok)
    tl.store(ml_ptr + part * 2 + 1, l, mask=head_ok)


# Each split covers a fixed span of key positions, at least MIN_SPLIT_TOKENS and enough that there are at most
# MAX_SPLITS: a row's keys are then split the same way whatever other rows share the call, so its result does not
# depend on the batch (empty splits weigh exactly zero in the merge). Short spans keep a few rows' GPU busy; the
# cap bounds the partial results, which are written and merged whether or not a split holds keys (a CUDA graph's
# block tables are as wide as the longest sequence allowed).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
TOKENS_PER_STEP = 64  # keys per iteration: four 16-token blocks, one tensor-core dot each way


def paged_decode(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None, alibi_slopes: torch.Tensor | None = None,
    max_seq_len: int | None = None, kv_scales: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of decode queries q [B, H, D] over their cached keys/values ([num_blocks, block_size, Hkv, D]),
    sequence i's blocks listed in block_tables[i] and its length (the query's position + 1) in seq_lens[i];
    `max_seq_len`: the longest (default: the block table's width); `kv_scales` [2, Hkv] (float32): an FP8 cache's;
    `softcap`: scaled scores s become softcap * tanh(s / softcap)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert num_heads % num_kv_heads == 0 and key_cache.stride(3) == 1 and q.stride(2) == 1
    group = num_heads // num_kv_heads
    max_blocks = -(-max_seq_len // block_size) if max_seq_len else block_tables.shape[1]
    per_step = TOKENS_PER_STEP // block_size
    blocks_per_split = max(-(-MIN_SPLIT_TOKENS // block_size), -(-max_blocks // MAX_SPLITS))
    blocks_per_split = -(-blocks_per_split // per_step) * per_step  # whole iterations per split
    splits = -(-max_blocks // blocks_per_split)
    acc = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    slopes = alibi_slopes if alibi_slopes is not None else q.new_empty(0, dtype=torch.float32)
    fp8 = kv_scales is not None
    assert not fp8 or (kv_scales.shape == (2, num_kv_heads) and kv_scales.is_contiguous()
                       and kv_scales.dtype == torch.float32), "an FP8 cache's scales: float32 [2, Hkv]"
    assert fp8 == (key_cache.dtype == torch.float8_e4m3fn), "an FP8 cache needs its scales (and only it has any)"
    assert block_tables.stride(1) == 1, "each row's block ids must be contiguous"
    _paged_decode[(batch, num_kv_heads, splits)](
        q, key_cache, value_cache, block_tables, seq_lens, slopes, kv_scales if fp8 else slopes, acc, ml,
        scale, sliding_window or NO_WINDOW, softcap or 1.0, blocks_per_split,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, DIM_P=triton.next_power_of_2(head_dim), GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, TOKENS=TOKENS_PER_STEP,
        HAS_ALIBI=alibi_slopes is not None, IEEE=q.dtype == torch.float32, FP8=fp8, SOFTCAP=softcap is not None,
    )
    out = torch.empty_like(q)
    _merge_splits[(batch, num_heads)](acc, ml, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                      DIM_P=triton.next_power_of_2(head_dim), SPLITS=splits,
                                      SPLITS_P=triton.next_power_of_2(splits))
    return out


@triton.jit
def _merge_splits_kernel(acc_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
                         SPLITS: tl.constexpr, SPLITS_P: tl.constexpr):
    """One (row, head): its splits' partial outputs weighed by their softmax mass, as one softmax over all keys.
    A split without keys has m = -inf and weighs zero."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    part = (row * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS_P)
    split_ok = tl.arange(0, SPLITS_P) < SPLITS
    m = tl.load(ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))
    dims = tl.arange(0, DIM_P)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :],
                  other=0.0)
    merged = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# Eager decode steps launch these twice a layer: launched directly (launch.py says why).
_paged_decode = Launcher(_paged_decode_kernel)
_merge_splits = Launcher(_merge_splits_kernel)
