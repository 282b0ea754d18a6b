"""Splitting a few-row quantized product's input features across programs (split-K), shared by the W4A16 and FP8
kernels.

A decode step's product reads a large weight once and does little arithmetic with it, so a launch needs many
programs streaming weights at once, more than its output tiles give. The input features are split across
programs; each split writes its own float32 partial of the tile, and the partials are added in split order (the
same result every run, unlike atomic adds), with the bias, then cast: by the tile's last split to finish, counted
with an atomic in `counters` ("in-kernel"), or by a second launch (`sum_splits`). Shapes and splits depend only on
M, N, K: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher

REDUCE_BLOCK = 256
COUNTERS = 4096  # output tiles a layer's counters cover; a product with more (never split in practice) takes a launch


@functools.cache
def sm_count(device_index: int) -> int:
    if not torch.cuda.is_available():  # TRITON_INTERPRET=1 on the CPU: any figure does
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(tiles: int, blocks: int, most_splits: int, programs_per_sm: int,
               device: torch.device) -> tuple[int, int]:
    """(splits, blocks per split) of `blocks` input blocks so that tiles x splits gives `programs_per_sm` programs
    per SM: the most splits, up to that and to `most_splits` (the partials' traffic a caller allows), that divide
    the blocks evenly (no split runs short, so the kernels need no bound of their own)."""
    wanted = sm_count(device.index or 0) * programs_per_sm // tiles
    wanted = max(1, min(blocks, wanted, most_splits))
    splits = max(d for d in range(1, wanted + 1) if blocks % d == 0)
    return splits, blocks // splits


@triton.jit
def store_tile(acc, bias_ptr, out_ptr, rows, cols, ok, col_ok, stride_out, HAS_BIAS: tl.constexpr):
    """out[rows, cols] = acc (+ bias), in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def finish_tile(acc, bias_ptr, out_ptr, partial_ptr, counters_ptr, rows, cols, M, N, stride_out, tile,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, REDUCE_HERE: tl.constexpr):
    """Where a program's float32 tile acc [rows, cols] goes (the split is the grid's third axis): into the output
    when the product is not split; else into its split's partial [splits, M, N] and, with REDUCE_HERE, the tile's
    last split to arrive adds them all into the output and resets the tile's counter for the next call."""
    row_ok = rows < M
    col_ok = cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    if not PARTIAL:
        store_tile(acc, bias_ptr, out_ptr, rows, cols, ok, col_ok, stride_out, HAS_BIAS)
    else:
        split_axis: tl.constexpr = 2
        partial_at = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(partial_at + tl.program_id(split_axis) * M * N, acc, mask=ok)
        if REDUCE_HERE:
            # The barrier puts every thread's store before the release of the counter's increment; the second,
            # every thread's loads after its acquire.
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(split_axis) - 1:
                tl.debug_barrier()
                total = tl.zeros(acc.shape, dtype=tl.float32)
                for other in range(0, tl.num_programs(split_axis)):
                    total += tl.load(partial_at + other * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                store_tile(total, bias_ptr, out_ptr, rows, cols, ok, col_ok, stride_out, HAS_BIAS)
                tl.atomic_xchg(counters_ptr + tile, 0)


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_out,
                       SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + (split * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


_sum_splits = Launcher(_sum_splits_kernel)


class SplitLaunch:
    """The buffers and flags of one split product: `partial` (the output itself when unsplit), `counters` and
    whether the kernel adds the partials itself (`reduce_here`); `finish()` after the kernel adds them otherwise."""

    def __init__(self, m: int, n: int, splits: int, tiles: int, out: torch.Tensor, counters: torch.Tensor | None,
                 in_kernel: bool) -> None:
        self.splits, self.out = splits, out
        self.partial = torch.empty(splits, m, n, dtype=torch.float32, device=out.device) if splits > 1 else out
        self.reduce_here = splits > 1 and in_kernel and counters is not None and counters.numel() >= tiles
        self.counters = counters if self.reduce_here else out

    def finish(self, bias: torch.Tensor | None) -> torch.Tensor:
        if self.splits > 1 and not self.reduce_here:
            sum_splits(self.partial, bias, self.out)
        return self.out


def sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the float32 partials [splits, M, N] added in split order (+ bias), in out's dtype."""
    splits, m, n = partial.shape
    has_bias = bias is not None
    _sum_splits[(m, triton.cdiv(n, REDUCE_BLOCK))](partial, bias if has_bias else partial, out, m, n, out.stride(0),
                                                  SPLITS=splits, BLOCK=REDUCE_BLOCK, HAS_BIAS=has_bias, num_warps=4)


def split_counters(device: torch.device) -> torch.Tensor:
    """The tile counters a layer passes to its kernel (enough for any split product: splits need few rows); calls
    that share them must run one after another (one stream)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)
