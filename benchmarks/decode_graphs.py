"""Decode steps as CUDA graphs against eager steps, in one process on the same model: `python -m benchmarks.decode_graphs`.

A random model of Llama-3.1-8B's shape (bfloat16) and two engines sharing it, one with `cuda_graphs` and one
without. For each case (rows, distinct adapters, prompt length), the requests are prefilled first and then only
the decode steps are timed; requests that finish early leave, as in serving. Adapters are random, rank 16, on all
seven projections. CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks.adapters import AdapterSpec, random_adapter
from benchmarks.progress import needs_cuda, progress
from benchmarks.random_models import llama_8b
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.params import SamplingParams

CASES = [(1, 0, 256), (1, 1, 256), (32, 0, 256), (32, 8, 256), (64, 0, 1000), (64, 64, 1000)]


# Every case's prompts in one prefill step (64 x 1,000 tokens): with the default budget (4,096 tokens a step) the
# first requests decode while the last are prefilled, finish first, and the timed steps run fewer rows.
PREFILL_ALL = 64 * 1024


def engine_for(loaded, **overrides) -> Engine:
    """The engine every case runs on: up to 64 requests of up to 1,200 tokens, 64 adapter slots of rank 16."""
    return Engine(loaded, EngineConfig(
        device="cuda", max_batch_total_tokens=64 * 1200, max_num_seqs=64, max_input_length=1024, max_total_tokens=1200,
        max_active_adapters=64, max_lora_rank=16, prefix_caching=False, max_batch_prefill_tokens=PREFILL_ALL,
        **overrides))


def decode_ms_per_step(engine: Engine, adapters, rows: int, distinct: int, prompt_len: int, new_tokens: int) -> float:
    for i in range(rows):
        prompt = [3 + (i * 7 + j) % 1000 for j in range(prompt_len)]
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), f"r{time.perf_counter()}-{i}",
                           adapter=adapters[i % distinct] if distinct else None)
    scheduler = engine.scheduler
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in [*scheduler.running, *scheduler.waiting]):
        engine.step()
    # Steps the scheduler planned, not calls: with overlapped steps the last call only reads the last step's tokens.
    steps, schedule = 0, engine.scheduler.schedule

    def counted():
        nonlocal steps
        plan = schedule()
        steps += bool(plan.scheduled)
        return plan

    torch.cuda.synchronize()
    started = time.perf_counter()
    engine.scheduler.schedule = counted
    try:
        while engine.has_unfinished:
            engine.step()
        torch.cuda.synchronize()
    finally:
        engine.scheduler.schedule = schedule
    return (time.perf_counter() - started) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.decode_graphs")) is not None:
        return code
    log(f"decode steps, CUDA graphs against eager, 8B shape ({args.layers} layers) on {torch.cuda.get_device_name()}: "
        f"{len(CASES)} cases, each warmed up then timed in both engines (a few minutes)")
    log(f"building the random 8B-shaped model ({args.layers} layers) and two engines")
    loaded = llama_8b(torch.device("cuda"), args.layers, torch.bfloat16)
    engines = {graphs: engine_for(loaded, cuda_graphs=graphs) for graphs in (True, False)}
    adapters = [random_adapter(f"a{i}", engines[True].lora.base_shapes, AdapterSpec(), 16, i) for i in range(64)]
    # Warm-up: captures, kernel compiles. As long as the timed runs: a short one can finish its requests while
    # others are still prefilled (mixed steps), never reaching the full batch's bucket, whose capture would then
    # land in the timed run.
    for graphs, engine in engines.items():
        log(f"warming up the {'graphed' if graphs else 'eager'} engine on every case (captures, kernel compiles)")
        for case in CASES:
            decode_ms_per_step(engine, adapters, *case, new_tokens=args.new_tokens)
    print(f"{loaded.model_id}, load average {os.getloadavg()[0]:.1f}")
    for rows, distinct, prompt_len in CASES:
        log(f"timing rows {rows}, adapters {distinct}, prompt {prompt_len}")
        ms = {g: decode_ms_per_step(e, adapters, rows, distinct, prompt_len, args.new_tokens) for g, e in engines.items()}
        print(f"rows {rows:3d}, adapters {distinct:2d}, prompt {prompt_len}: graphs {ms[True]:.2f} ms/step "
              f"({rows * 1e3 / ms[True]:.0f} tok/s), eager {ms[False]:.2f} ms/step: {ms[False] / ms[True]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
