"""The tile form of per-row LoRA in Triton (SGMV; tiles.py says what a tile is): `out[i] += scale * (x[i] @ A.T) @
B.T` for every row i of every tile, with the tile's slot's A and B found through `PointerTable`' tables.

Two kernels, each launched once for up to three sibling layers that share their input, as `bgmv.py`'s are. Shrink:
one program per (tile, split of the input features, layer) multiplies the tile's rows [TILE_ROWS, in] by A.T on
tensor cores, writing its own float32 partial (fixed summation order: the same result every run). Expand: one
program per (tile, block of one layer's output features) sums the partials and multiplies them by that block of
B.T, adding the scaled result to `out` in place. A tile whose slot's rank for the layer is 0 returns at once.

Each output row is the product of its own input row only (a matrix product's rows are independent), so a NaN in
one row reaches no other, as the isolation rule asks. In float32 the products are exact IEEE ones (no TF32), as the
float32 tests compare them with the reference; in bfloat16 the expand multiplies in TF32, which keeps more of the
float32 partials than rounding them to bfloat16 would.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher
from loraplex.lora.step.kernels.bgmv import _pick
from loraplex.lora.step.kernels.rows import PointerTable, sibling_launch
from loraplex.lora.step.kernels.tiles import TILE_ROWS
from loraplex.lora.step.row_maps import LoraTiles

BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 64  # output features per expand program
TARGET_PROGRAMS = 1056  # shrink programs wanted: split the input features when the tiles are few (as bgmv.py)

# Values that vary from call to call: compiled once, not once per divisibility of each (nor per split count).
_PER_CALL = ["num_tiles", "num_rows", "layer0", "layer1", "layer2", "splits", "off0", "off1", "off2", "blocks0",
             "blocks01"]


@triton.jit
def _tile(tiles_ptr, num_tiles, tile, entry_layer, num_slots, ranks_ptr):
    """A tile's first row, its number of rows, its slot's entry in the tables for the layer, and that rank."""
    slot = tl.load(tiles_ptr + 2 * num_tiles + tile)
    entry = entry_layer.to(tl.int64) * num_slots + slot
    return tl.load(tiles_ptr + tile), tl.load(tiles_ptr + num_tiles + tile), entry, tl.load(ranks_ptr + entry)


@triton.jit(do_not_specialize=_PER_CALL[:5])
def _tile_shrink_kernel(x_ptr, tiles_ptr, num_tiles, num_rows, pointers_ptr, ranks_ptr, partial_ptr, in_features, per_split,
                   stride_x, num_slots, layer0, layer1, layer2, RANK_P: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2)
    first, count, entry, rank = _tile(tiles_ptr, num_tiles, tile, _pick(g, layer0, layer1, layer2), num_slots,
                                      ranks_ptr)
    if rank == 0:
        return
    a_ptr = tl.multiple_of(tl.load(pointers_ptr + entry * 2).to(x_ptr.dtype), 16)  # A [rank, in], row-major
    rows = tl.arange(0, ROWS)
    row_ok = rows < count
    ranks = tl.arange(0, RANK_P)
    rank_ok = ranks < rank
    acc = tl.zeros([ROWS, RANK_P], tl.float32)
    begin = split * per_split
    end = tl.minimum(begin + per_split, in_features)
    for k in range(0, per_split, BLOCK):
        cols = begin + k + tl.arange(0, BLOCK)
        col_ok = cols < end
        x = tl.load(x_ptr + (first + rows).to(tl.int64)[:, None] * stride_x + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        a_t = tl.load(a_ptr + ranks[None, :] * in_features + cols[:, None], mask=rank_ok[None, :] & col_ok[:, None],
                      other=0.0)  # [BLOCK, RANK_P]: A.T's block
        if IEEE:
            acc = tl.dot(x, a_t, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a_t, acc)
    part = ((g * num_rows + first + rows).to(tl.int64) * tl.num_programs(1) + split) * RANK_P
    tl.store(partial_ptr + part[:, None] + ranks[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=_PER_CALL)
def _tile_expand_kernel(out_ptr, tiles_ptr, num_tiles, num_rows, pointers_ptr, ranks_ptr, scales_ptr, partial_ptr, stride_o,
                   num_slots, layer0, layer1, layer2, splits, n0, n1, n2, off0, off1, off2, blocks0, blocks01,
                   RANK_P: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    block = tl.program_id(1)
    g = (block >= blocks0).to(tl.int32) + (block >= blocks01).to(tl.int32)  # this block's layer
    first, count, entry, rank = _tile(tiles_ptr, num_tiles, tile, _pick(g, layer0, layer1, layer2), num_slots,
                                      ranks_ptr)
    if rank == 0:
        return
    out_features = _pick(g, n0, n1, n2)
    b_ptr = tl.multiple_of(tl.load(pointers_ptr + entry * 2 + 1).to(out_ptr.dtype), 16)  # B.T [rank, out], row-major
    rows = tl.arange(0, ROWS)
    row_ok = rows < count
    ranks = tl.arange(0, RANK_P)
    rank_ok = ranks < rank
    part = (g * num_rows + first + rows).to(tl.int64) * splits
    shrunk = tl.zeros([ROWS, RANK_P], tl.float32)
    for split in range(splits):
        shrunk += tl.load(partial_ptr + ((part + split) * RANK_P)[:, None] + ranks[None, :], mask=row_ok[:, None],
                          other=0.0)
    cols = (block - _pick(g, 0, blocks0, blocks01)) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < out_features
    b_t = tl.load(b_ptr + ranks[:, None] * out_features + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                  other=0.0).to(tl.float32)
    if IEEE:
        delta = tl.dot(shrunk, b_t, input_precision="ieee")
    else:
        delta = tl.dot(shrunk, b_t, input_precision="tf32")
    delta = delta * tl.load(scales_ptr + entry)
    at = out_ptr + (first + rows).to(tl.int64)[:, None] * stride_o + _pick(g, off0, off1, off2) + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    out = tl.load(at, mask=mask, other=0.0)
    tl.store(at, (out.to(tl.float32) + delta).to(out.dtype), mask=mask)


# Eager steps launch these for every sibling group of every layer: launched directly (launch.py says why).
_shrink = Launcher(_tile_shrink_kernel)
_expand = Launcher(_tile_expand_kernel)


def add_lora_tiles_siblings(outs: Sequence[torch.Tensor], x: torch.Tensor, tiles: LoraTiles, tables: PointerTable,
                            names: Sequence[str], max_rank: int) -> None:
    """outs[g] += each tiled row's delta of layer names[g], for up to three layers that share the input x [T, in];
    the outputs are column slices of one tensor [T, *] (one fused product's; a single output is its own)."""
    rows = x.shape[0]
    launch = sibling_launch(outs, x, tables, names, max_rank, tiles.count, BLOCK_N, BLOCK_K, TARGET_PROGRAMS)
    if tiles.count == 0 or rows == 0:
        return
    blocks = launch.blocks
    out = outs[launch.base]
    partial = torch.empty(len(outs), rows, launch.splits, launch.rank_p, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    _shrink[(tiles.count, launch.splits, len(outs))](
        x, tiles.table, tiles.count, rows, tables.pointers, tables.ranks, partial, x.shape[1], launch.per_split,
        x.stride(0), tables.num_slots, *launch.layers, RANK_P=launch.rank_p, ROWS=TILE_ROWS, BLOCK=BLOCK_K, IEEE=ieee)
    _expand[(tiles.count, sum(blocks))](
        out, tiles.table, tiles.count, rows, tables.pointers, tables.ranks, tables.scales, partial,
        out.stride(0), tables.num_slots, *launch.layers, launch.splits, *launch.widths, *launch.offsets,
        blocks[0], blocks[0] + blocks[1], RANK_P=launch.rank_p, ROWS=TILE_ROWS, BLOCK=BLOCK_N, IEEE=ieee)
