"""The per-row LoRA Triton kernels alone (lora/step/kernels/bgmv.py), eager and replayed in a CUDA graph, with the
bandwidth they reach over the distinct adapters' bytes: `python -m benchmarks.lora_rows`. CUDA only."""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.progress import needs_cuda, progress

from loraplex.lora.adapter import LoraWeights
from loraplex.lora.step.kernels import PointerTable
from loraplex.lora.device.upload import laid_out

CASES = [(1, 1), (32, 8), (64, 64)]  # (rows, distinct adapters)
SHAPES = [(4096, 14336), (14336, 4096), (4096, 1024)]  # Llama-3.1-8B's up, down and k/v projections
RANK = 16


def microseconds(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.lora_rows")) is not None:
        return code
    log(f"per-row LoRA kernels on {torch.cuda.get_device_name()}: {len(CASES) * len(SHAPES)} cases "
        "(the first compiles the Triton kernel; under a minute)")
    from loraplex.lora.step.kernels.bgmv import add_lora_rows

    device, dtype = torch.device("cuda"), torch.bfloat16
    for rows, distinct in CASES:
        for in_features, out_features in SHAPES:
            log(f"timing rows {rows}, adapters {distinct}, {in_features} -> {out_features}")
            tables = PointerTable(["layer"], distinct, device)
            weights = [laid_out(LoraWeights(torch.randn(RANK, in_features, device=device, dtype=dtype) * 0.01,
                                            torch.randn(out_features, RANK, device=device, dtype=dtype), 2.0))
                       for _ in range(distinct)]
            for slot, w in enumerate(weights):
                tables.set_slot(slot, {"layer": w})
            x = torch.randn(rows, in_features, device=device, dtype=dtype)
            out = torch.zeros(rows, out_features, device=device, dtype=dtype)
            slots = torch.arange(rows, device=device) % distinct
            eager = microseconds(lambda: add_lora_rows(out, x, slots, tables, "layer", RANK))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                add_lora_rows(out, x, slots, tables, "layer", RANK)
            replayed = microseconds(graph.replay)
            nbytes = distinct * (in_features + out_features) * RANK * dtype.itemsize
            print(f"rows {rows:2d}, adapters {distinct:2d}, {in_features} -> {out_features}: eager {eager:.1f} us, "
                  f"in a graph {replayed:.1f} us = {nbytes / replayed / 1e3:.0f} GB/s of adapter weights", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
