"""The per-row LoRA form in Triton (BGMV): `out[i] += scale * (x[i] @ A.T) @ B.T` with row i's own slot's A and
B, found through `PointerTable`' tables, so one launch serves rows of any mix of adapters and ranks, and a CUDA
graph that captured it reads whatever adapter a slot holds at replay.

Two kernels, each launched once for up to three sibling layers that share their input (q/k/v, gate/up: the
slices of one fused product, `layers/projections.py`); a program picks its layer from its program id. Shrink:
one program per (row, split of the input features, layer) sums its part of x[i] @ A.T in float32 (splits keep a
few rows' shrink spread over the GPU; each split writes its own partial, so the sum's order is fixed: no atomics,
the same result every run). Expand: one program per (row, block of one layer's output features) adds the
partials and multiplies by that block of B, adding the scaled result to `out` in place. A row whose slot is -1,
or whose slot's rank for the layer is 0, returns at once: its output is never written, so nothing of any adapter
reaches it. `rows.add_lora_rows_reference` is the reference (tests/gpu/test_gpu_lora_rows.py).

`add_lora_rows_siblings` launches both; `shrink_rows_at` launches the shrink alone, planned from the columns the
outputs will have, and its `RowShrink.expand` the expand once they exist: in a CUDA graph the shrink runs beside
the base product that fills them (`lora/step/beside.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.lora.step.kernels.rows import PointerTable, SiblingLaunch, sibling_launch, sibling_launch_at

# Launch shapes from a sweep at Llama-8B's shapes (many rows over many adapters, and few over few): the kernels are
# short, so many small programs (eight per SM for the shrink) beat a few long ones.
BLOCK_K = 128  # input features per shrink iteration
SHRINK_WARPS = 8
BLOCK_N = 128  # output features per expand program
EXPAND_WARPS = 1
TARGET_PROGRAMS = 1056  # shrink programs wanted: enough splits of the input that even one row keeps the GPU reading

# Layer indices and offsets vary from call to call: compiled once, not once per divisibility of each value.
_PER_CALL = ["layer0", "layer1", "layer2", "off0", "off1", "off2", "blocks0", "blocks01"]


@triton.jit
def _pick(g, first, second, third):
    return tl.where(g == 0, first, tl.where(g == 1, second, third))


@triton.jit(do_not_specialize=_PER_CALL[:3])
def _row_shrink_kernel(x_ptr, row_slots_ptr, pointers_ptr, ranks_ptr, partial_ptr, in_features, per_split, stride_x,
                   num_slots, layer0, layer1, layer2, RANK_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    entry = _pick(g, layer0, layer1, layer2).to(tl.int64) * num_slots + slot
    rank = tl.load(ranks_ptr + entry)
    if rank == 0:
        return
    # A [rank, in], row-major. Its address comes from memory: say it is aligned (PointerTable checks), or every
    # load would be split into single elements.
    a_ptr = tl.multiple_of(tl.load(pointers_ptr + entry * 2).to(x_ptr.dtype), 16)
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
    part = (g * tl.num_programs(0) + row) * tl.num_programs(1) + split
    tl.store(partial_ptr + part * RANK_P + ranks, acc)


@triton.jit(do_not_specialize=_PER_CALL)
def _row_expand_kernel(out_ptr, row_slots_ptr, pointers_ptr, ranks_ptr, scales_ptr, partial_ptr, stride_o, num_slots,
                   layer0, layer1, layer2, n0, n1, n2, off0, off1, off2, blocks0, blocks01,
                   SPLITS: tl.constexpr, RANK_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    g = (block >= blocks0).to(tl.int32) + (block >= blocks01).to(tl.int32)  # this block's layer
    entry = _pick(g, layer0, layer1, layer2).to(tl.int64) * num_slots + slot
    rank = tl.load(ranks_ptr + entry)
    if rank == 0:
        return
    out_features = _pick(g, n0, n1, n2)
    b_ptr = tl.multiple_of(tl.load(pointers_ptr + entry * 2 + 1).to(out_ptr.dtype), 16)  # B.T [rank, out], row-major
    ranks = tl.arange(0, RANK_P)
    rank_ok = ranks < rank
    shrunk = tl.zeros([RANK_P], tl.float32)
    first = (g * tl.num_programs(0) + row) * SPLITS
    for split in range(SPLITS):
        shrunk += tl.load(partial_ptr + (first + split) * RANK_P + ranks)
    cols = (block - _pick(g, 0, blocks0, blocks01)) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < out_features
    b = tl.load(b_ptr + ranks[:, None] * out_features + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    delta = tl.sum(b * shrunk[:, None], axis=0) * tl.load(scales_ptr + entry)
    at = out_ptr + row * stride_o + _pick(g, off0, off1, off2) + cols
    out = tl.load(at, mask=col_ok, other=0.0)
    tl.store(at, (out.to(tl.float32) + delta).to(out.dtype), mask=col_ok)


# Eager steps launch these for every sibling group of every layer: launched directly (launch.py says why).
_shrink = Launcher(_row_shrink_kernel)
_expand = Launcher(_row_expand_kernel)


def add_lora_rows(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, tables: PointerTable, name: str,
                  max_rank: int) -> torch.Tensor:
    """out [T, out] += each row's own delta; x [T, in] in the weights' dtype; row_slots [T] (-1: none)."""
    add_lora_rows_siblings([out], x, row_slots, tables, [name], max_rank)
    return out


def add_lora_rows_siblings(outs: Sequence[torch.Tensor], x: torch.Tensor, row_slots: torch.Tensor,
                           tables: PointerTable, names: Sequence[str], max_rank: int) -> None:
    """outs[g] += each row's delta of layer names[g], for up to three layers that share the input x [T, in]; the
    outputs are column slices of one tensor [T, *] (one fused product's; a single output is its own)."""
    launch = sibling_launch(outs, x, tables, names, max_rank, x.shape[0], BLOCK_N, BLOCK_K, TARGET_PROGRAMS)
    shrink_rows(x, row_slots, tables, launch).expand(outs)


def shrink_rows_at(offsets: Sequence[int], widths: Sequence[int], x: torch.Tensor, row_slots: torch.Tensor,
                   tables: PointerTable, names: Sequence[str], max_rank: int) -> RowShrink:
    """The shrink of `add_lora_rows_siblings`, launched before its outputs exist: they will be the columns
    `offsets`, `widths` of one tensor (the base product's; the shrink reads only x, so it may run beside it)."""
    launch = sibling_launch_at(offsets, widths, x, tables, names, max_rank, x.shape[0], BLOCK_N, BLOCK_K,
                               TARGET_PROGRAMS)
    return shrink_rows(x, row_slots, tables, launch)


@dataclass(frozen=True)
class RowShrink:
    """A launched shrink: the partial sums its expand reads (on the device) and what that expand launches with."""

    launch: SiblingLaunch
    partial: torch.Tensor
    row_slots: torch.Tensor
    tables: PointerTable

    def expand(self, outs: Sequence[torch.Tensor]) -> None:
        """outs[g] += each row's delta (the outputs the shrink was planned for, in its order)."""
        launch, tables = self.launch, self.tables
        blocks = launch.blocks
        out = outs[launch.base]
        _expand[(out.shape[0], sum(blocks))](
            out, self.row_slots, tables.pointers, tables.ranks, tables.scales, self.partial, out.stride(0),
            tables.num_slots, *launch.layers, *launch.widths, *launch.offsets, blocks[0], blocks[0] + blocks[1],
            SPLITS=launch.splits, RANK_P=launch.rank_p, BLOCK=BLOCK_N, num_warps=EXPAND_WARPS)


def shrink_rows(x: torch.Tensor, row_slots: torch.Tensor, tables: PointerTable, launch: SiblingLaunch) -> RowShrink:
    """Launches the shrink of x as `launch` plans it, into partial sums of its own."""
    rows = x.shape[0]
    partial = torch.empty(launch.count, rows, launch.splits, launch.rank_p, dtype=torch.float32,
                          device=x.device)
    _shrink[(rows, launch.splits, launch.count)](
        x, row_slots, tables.pointers, tables.ranks, partial, x.shape[1], launch.per_split, x.stride(0),
        tables.num_slots, *launch.layers, RANK_P=launch.rank_p, BLOCK=BLOCK_K, num_warps=SHRINK_WARPS)
    return RowShrink(launch, partial, row_slots, tables)
