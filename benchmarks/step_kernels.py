"""Where a decode step's GPU time goes: its captured graph replayed under the torch profiler, the kernels' times
grouped by kind, each kind against the bytes it must read (benchmarks/roofline.py). `python -m
benchmarks.step_shares --kernels` prints it for every case. CUDA only.

A kernel's kind comes from its name: cuBLAS matmuls read the weights, the paged-decode kernel (and its merge of
splits) the KV cache, the LoRA shrink and expand kernels the adapters; the rest (norms, rotary, activation, the KV
write, embedding, argmax, copies) read little. The replay's time beyond the kernels' sum is the gaps between them.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# (kind, substrings of its kernels' names, lowercased); the first match wins.
KINDS = (
    ("matmuls", ("gemm", "gemv", "nvjet", "cutlass", "splitk", "xmma")),
    ("attention", ("paged_decode", "merge_splits")),
    ("lora", ("shrink_kernel", "expand_kernel")),
    ("elementwise", ("rms_norm", "rotary", "silu_and_mul", "write_kv")),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, parts in KINDS if any(p in name for p in parts)), "other")


def kernel_ms_by_kind(graph: torch.cuda.CUDAGraph, replays: int = 10) -> dict[str, float]:
    """Milliseconds per replay of each kind's kernels (and copies: "other")."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[kind_of(event.name)] += event.time_range.elapsed_us()
    return {kind: us / replays / 1e3 for kind, us in totals.items()}


def describe(by_kind: dict[str, float], replay_ms: float, bytes_by_kind: dict[str, int]) -> list[str]:
    """One line per kind: ms per step, share of the replay, and GB/s where the kind's bytes are known."""
    lines = []
    for kind in [k for k, _ in KINDS] + ["other"]:
        ms = by_kind.get(kind, 0.0)
        if not ms:
            continue
        read = bytes_by_kind.get(kind)
        rate = f", {read / 1e9:.2f} GB at {read / ms / 1e6:,.0f} GB/s" if read else ""
        lines.append(f"    {kind:<12} {ms:6.2f} ms ({ms / replay_ms:.0%}){rate}")
    gaps = replay_ms - sum(by_kind.values())
    lines.append(f"    {'gaps':<12} {gaps:6.2f} ms ({gaps / replay_ms:.0%})")
    return lines
