"""The per-row LoRA form in Triton (BGMV): `out[i] += scale * (x[i] @ A.T) @ B.T` with row i's own slot's A and
B, found through `SlotPointers`' tables, so one launch serves rows of any mix of adapters and ranks, and a CUDA
graph that captured it reads whatever adapter a slot holds at replay.

Two kernels. Shrink: one program per (row, split of the input features) sums its part of x[i] @ A.T in float32
(splits keep a few rows' shrink spread over the GPU; each split writes its own partial, so the sum's order is
fixed: no atomics, the same result every run). Expand: one program per (row, block of output features) adds
the partials and multiplies by that block of B, adding the scaled result to `out` in place. A row whose slot is
-1, or whose slot's rank for this layer is 0, returns at once: its output is never written, so nothing of any
adapter reaches it. `rows.add_lora_rows_reference` is the reference (tests/gpu/test_gpu_lora_rows.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.lora.kernels.rows import SlotPointers

BLOCK_K = 256  # input features per shrink iteration
BLOCK_N = 128  # output features per expand program
TARGET_PROGRAMS = 264  # two per SM of the H200: enough shrink splits that one row keeps the GPU reading


@triton.jit
def _shrink_kernel(x_ptr, row_slots_ptr, pointers_ptr, ranks_ptr, partial_ptr, in_features, per_split, stride_x,
                   RANK_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    # A [rank, in], row-major. Its address comes from memory: say it is aligned (SlotPointers checks), or every
    # load would be split into single elements.
    a_ptr = tl.multiple_of(tl.load(pointers_ptr + slot * 2).to(x_ptr.dtype), 16)
    ranks = tl.arange(0, RANK_P)
    rank_ok = ranks < rank
    acc = tl.zeros([RANK_P], tl.float32)
    begin = split * per_split
    end = tl.minimum(begin + per_split, in_features)
    for k in range(begin, end, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        col_ok = cols < end
        x = tl.load(x_ptr + row * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ranks[:, None] * in_features + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(partial_ptr + (row * tl.num_programs(1) + split) * RANK_P + ranks, acc)


@triton.jit
def _expand_kernel(out_ptr, row_slots_ptr, pointers_ptr, ranks_ptr, scales_ptr, partial_ptr, out_features, stride_o,
                   SPLITS: tl.constexpr, RANK_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    b_ptr = tl.multiple_of(tl.load(pointers_ptr + slot * 2 + 1).to(out_ptr.dtype), 16)  # B.T [rank, out], row-major
    ranks = tl.arange(0, RANK_P)
    rank_ok = ranks < rank
    shrunk = tl.zeros([RANK_P], tl.float32)
    for split in range(SPLITS):
        shrunk += tl.load(partial_ptr + (row * SPLITS + split) * RANK_P + ranks)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < out_features
    b = tl.load(b_ptr + ranks[:, None] * out_features + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    delta = tl.sum(b * shrunk[:, None], axis=0) * tl.load(scales_ptr + slot)
    out = tl.load(out_ptr + row * stride_o + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (out.to(tl.float32) + delta).to(out.dtype), mask=col_ok)


def add_lora_rows(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, tables: SlotPointers, name: str,
                  max_rank: int) -> torch.Tensor:
    """out [T, out] += each row's own delta; x [T, in] in the weights' dtype; row_slots [T] int32 (-1: none)."""
    rows, in_features = x.shape
    out_features = out.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and x.dtype == out.dtype
    pointers, ranks, scales = tables.layer(name)
    rank_p = max(16, triton.next_power_of_2(max_rank))
    splits = max(1, min(-(-TARGET_PROGRAMS // max(rows, 1)), -(-in_features // BLOCK_K)))
    per_split = -(-in_features // splits // BLOCK_K) * BLOCK_K
    splits = -(-in_features // per_split)
    partial = torch.empty(rows, splits, rank_p, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, splits)](x, row_slots, pointers, ranks, partial, in_features, per_split, x.stride(0),
                                   RANK_P=rank_p, BLOCK=BLOCK_K)
    _expand_kernel[(rows, triton.cdiv(out_features, BLOCK_N))](
        out, row_slots, pointers, ranks, scales, partial, out_features, out.stride(0),
        SPLITS=splits, RANK_P=rank_p, BLOCK=BLOCK_N)
    return out
