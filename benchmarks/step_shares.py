"""A decode step's wall time split into the GPU's share and the host's: `python -m benchmarks.step_shares`.

8B shape, bfloat16, CUDA graphs. For each case (rows, distinct adapters, prompt length) the requests are prefilled,
then decoded step by step (the wall time per step, each step returning its tokens to the host), then the step's
captured graph is replayed alone, back to back (the GPU's time per step, the gaps between its kernels included).
The difference is the host's: scheduling, staging the inputs, reading the tokens, updating the requests; the GPU
waits for it. With `--kernels`, the replay's kernels by kind against the bytes each must read
(benchmarks/step_kernels.py), and the step's roofline at the measured copy bandwidth. CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks import roofline, step_kernels
from benchmarks.adapters import AdapterSpec, random_adapter
from benchmarks.decode_graphs import decode_ms_per_step, engine_for
from benchmarks.progress import needs_cuda, progress
from benchmarks.random_models import llama_8b

CASES = [(1, 0, 256), (1, 1, 256), (32, 8, 256), (64, 0, 1000), (64, 64, 1000)]


def replay_ms(graph: torch.cuda.CUDAGraph, times: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(times):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / times * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--kernels", action="store_true", help="also where each replay's GPU time goes, by kernel kind")
    args = p.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.step_shares")) is not None:
        return code
    log(f"decode steps' GPU and host shares, 8B shape, on {torch.cuda.get_device_name()}: {len(CASES)} cases "
        "(a few minutes)")
    log("building the random 8B-shaped model (32 layers) and its engine")
    loaded = llama_8b(torch.device("cuda"), 32, torch.bfloat16)
    engine = engine_for(loaded)
    adapters = [random_adapter(f"a{i}", engine.lora.base_shapes, AdapterSpec(), 16, i) for i in range(64)]
    bandwidth = roofline.copy_bandwidth(torch.device("cuda"))
    print(f"{loaded.model_id}, load average {os.getloadavg()[0]:.1f}; bandwidth {bandwidth.describe()}")
    for rows, distinct, prompt_len in CASES:
        log(f"rows {rows}, adapters {distinct}, prompt {prompt_len}: warm-up, then timed")
        decode_ms_per_step(engine, adapters, rows, distinct, prompt_len, args.new_tokens)  # captures, compiles
        wall = decode_ms_per_step(engine, adapters, rows, distinct, prompt_len, args.new_tokens)
        graph = engine.runner.decode_graphs.captured(rows, with_adapters=distinct > 0)
        gpu = replay_ms(graph)
        print(f"rows {rows:2d}, adapters {distinct:2d}, prompt {prompt_len}: {wall:.2f} ms/step = GPU {gpu:.2f} "
              f"+ host {wall - gpu:.2f}", flush=True)
        if args.kernels:
            # The graph replays its last step: every row at about the prompt plus the new tokens.
            step = roofline.decode_step_bytes(loaded.model, loaded.config, loaded.dtype, rows,
                                              rows * (prompt_len + args.new_tokens), adapters[:distinct])
            print(f"    roofline {step.total / bandwidth.bytes_per_s * 1e3:.2f} ms ({step.total / 1e9:.1f} GB); "
                  f"the replay at {step.total / bandwidth.bytes_per_s * 1e3 / gpu:.0%} of it")
            by_kind = step_kernels.kernel_ms_by_kind(graph)
            read = {"matmuls": step.weights, "attention": step.kv, "lora": step.adapters}
            print("\n".join(step_kernels.describe(by_kind, gpu, read)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
