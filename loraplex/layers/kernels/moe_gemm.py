"""The experts' grouped product in Triton: out [P, N] = x [P, K] times each pair's expert's weight [E, N, K].T, for
(token row, expert) pairs sorted by expert (layers/moe.py: `grouped_product`, whose per-expert matmul loop is the
reference; tests/gpu/test_gpu_moe.py), every expert in one launch.

Each program computes one [BLOCK_M, BLOCK_N] tile of one expert's pairs. Think of each expert's pairs padded to
whole blocks of BLOCK_M rows and the blocks laid end to end in expert order: a program's M-block index names one of
them, and the program finds its expert, and the pairs of its block, from the per-expert pair counts alone (on the
device: a scan over the E counts, no table to build beforehand, no host sync). The launch is sized on the host by
an upper bound of those blocks that needs no counts: at most min(E, P) experts have pairs, each with at most
BLOCK_M - 1 padding rows, so there are at most (P + min(E, P) * (BLOCK_M - 1)) // BLOCK_M blocks; programs past the
real ones return at once. Shapes thus depend only on P, E, N, K: a CUDA graph captured once replays any routing.

The tensor cores multiply in the inputs' dtype (bfloat16 / float16) and add in float32, rounding once at the store,
as cuBLAS does; float32 inputs multiply in exact float32 (input_precision="ieee": what the reference computes, up
to the order of the sums). Configurations are fixed per size (CONFIGS), not autotuned (an autotuner would time
candidates inside a graph capture). Decode-sized products (a few pairs per expert: BLOCK_M 16, the split over
columns only) read each active expert's weight once; larger ones take taller tiles. M-blocks go through the column
tiles GROUP_M at a time, so that neighbouring programs share weight and input tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import Launcher

# (most pairs per active expert, BLOCK_M, BLOCK_N, bytes of K per step, GROUP_M, num_warps, num_stages): the first
# entry whose bound is >= P / min(E, P); BLOCK_K is those bytes over the element size. From `python -m
# benchmarks.moe --sweep` (Mixtral-8x7B's and Qwen1.5-MoE's shapes, H200 and H100): at decode sizes 64 columns a
# tile beat 16 and 32 (more programs, each streaming less) at every P, and 32 rows beat two blocks of 16 once experts
# get more than 16 pairs; for prefill, 128 x 256 tiles on 8 warps were the fastest tried.
CONFIGS = [(8, 16, 64, 512, 8, 4, 3), (32, 32, 64, 512, 8, 4, 3), (64, 64, 128, 128, 8, 4, 4),
           (None, 128, 256, 128, 8, 8, 4)]


def config(pairs: int, experts: int, n: int, k: int, element_size: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for `pairs` pairs over `experts` experts."""
    per_expert = pairs / max(1, min(experts, pairs))
    _, block_m, block_n, k_bytes, group_m, warps, stages = next(
        entry for entry in CONFIGS if entry[0] is None or per_expert <= entry[0])
    if element_size == 4 and block_n > 128:  # float32's exact products (no tensor cores): the 128-column tiles
        block_n, stages = 128, 3
    return block_m, block_n, min(k_bytes // element_size, max(16, triton.next_power_of_2(k))), group_m, warps, stages


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """An upper bound of the M-blocks of `pairs` pairs over `experts` experts, each expert's padded to BLOCK_M."""
    return (pairs + min(experts, pairs) * (block_m - 1)) // block_m


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, counts_ptr, out_ptr, P, N, K, m_blocks, stride_x, stride_we, stride_wn,
                    stride_out, EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                    IEEE: tl.constexpr):
    # This program's (M-block, column tile): GROUP_M M-blocks at a time go through every column tile together.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_blocks - first_m, GROUP_M)
    block = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    # Its expert: the one whose padded blocks (laid end to end in expert order) hold block number `block`.
    experts = tl.arange(0, EXPERTS_P)
    counts = tl.load(counts_ptr + experts, mask=experts < EXPERTS, other=0).to(tl.int32)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    expert = tl.sum((tl.cumsum(blocks, axis=0) <= block).to(tl.int32), axis=0)
    if expert >= EXPERTS:  # past the last expert's blocks: the launch's upper bound of them was not reached
        return
    before = experts < expert
    first_pair = tl.sum(tl.where(before, counts, 0), axis=0)
    end_pair = tl.minimum(first_pair + tl.sum(tl.where(experts == expert, counts, 0), axis=0), P)
    rows = first_pair + (block - tl.sum(tl.where(before, blocks, 0), axis=0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end_pair
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N

    # Rows and columns past the tile's edges read a real row (the expert's first pair) and column (wrapped) and are
    # never stored: the loads need no mask but K's.
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + tl.where(row_ok, rows, first_pair).to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_at = (w_ptr + expert.to(tl.int64) * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn + ks[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_at)
            b = tl.load(w_at)
        else:
            k_ok = ks < K - step * BLOCK_K
            a = tl.load(x_at, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_at, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


_grouped = Launcher(_grouped_kernel)  # twice a sparse layer, eager steps too: launched directly (launch.py)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [P, K] (pairs sorted by expert, `counts` [E] of them per expert, on the device) times each pair's expert's
    weight [E, N, K] (rows dense) transposed -> [P, N] in x's dtype (bfloat16, float16 or float32, as the weight)."""
    pairs, k = x.shape
    experts, n, _ = weight.shape
    assert weight.shape[2] == k and weight.stride(2) == 1 and weight.dtype == x.dtype
    assert counts.shape == (experts,) and counts.device == x.device
    if x.stride(1) != 1:
        x = x.contiguous()
    counts = counts.contiguous()
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n, block_k, group_m, warps, stages = config(pairs, experts, n, k, x.element_size())
    m_blocks = max_blocks(pairs, experts, block_m)
    _grouped[(m_blocks * triton.cdiv(n, block_n),)](
        x, weight, counts, out, pairs, n, k, m_blocks, x.stride(0), weight.stride(0), weight.stride(1),
        out.stride(0), EXPERTS=experts, EXPERTS_P=triton.next_power_of_2(experts), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=k % block_k == 0,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out
