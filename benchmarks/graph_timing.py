"""Timing GPU calls as a decode step runs them: captured in one CUDA graph, replayed, over enough copies of the
weights that none is in L2 when read (so every call reads its weight from HBM)."""

from __future__ import annotations

import math
from typing import Callable

import torch

L2_BYTES = 60 * 2**20  # above the H200's 50 MiB


def weight_copies(tensors: list[torch.Tensor], l2_bytes: int = L2_BYTES) -> list[list[torch.Tensor]]:
    """`tensors` and as many clones as make 4x the L2 together (at least two sets)."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    count = max(2, math.ceil(4 * l2_bytes / size))
    return [tensors] + [[t.clone() for t in tensors] for _ in range(count - 1)]


def graph_time_us(calls: list[Callable[[], object]], target_ms: float = 30.0) -> float:
    """Microseconds per call: `calls` captured in one CUDA graph (after two eager calls that compile and warm),
    replayed until `target_ms` passed."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    rounds = max(3, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3)))
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (rounds * len(calls))
