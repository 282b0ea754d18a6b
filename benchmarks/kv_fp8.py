"""The FP8 KV cache against the bfloat16 one, on a GPU: `python -m benchmarks.kv_fp8`.

1. Paged decode attention alone, one layer of Llama-3.1-8B's shape (32 heads, 8 KV heads, head dim 128, bf16
   queries), for batch 1/32/64 x context 1k/4k/16k: time per call of the Triton kernel over a bf16 cache and over
   an FP8 cache (per-KV-head scales), each replayed from a CUDA graph of `--calls` calls (kernel time, no host
   launch cost; median of 20 replays), the bandwidth each reaches reading its keys and values, and the largest
   difference of the FP8 output from the bf16 output over the same (FP8-rounded) values.
2. KV capacity in tokens for `--budget-gib` of cache at the 8B shape (32 layers), as engine/memory.py counts it.
3. With `--engine`: a random-weight model of the 8B shape served by the engine with each cache dtype in turn
   (default memory sizing, CUDA graphs): its KV capacity in tokens and its decode tokens/s for `--requests`
   requests of `--context` prompt tokens and 64 new ones.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch

from benchmarks.progress import needs_cuda, progress
from loraplex.config import EngineConfig
from loraplex.engine.memory import kv_bytes_per_token
from loraplex.layers.kv_quant import FP8_KV_DTYPE, dequantize, quantize
from loraplex.params import SamplingParams

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 8, 128, 16, 32
BATCHES, CONTEXTS = (1, 32, 64), (1024, 4096, 16384)


def graph_time(fn, calls: int, replays: int = 20) -> float:
    """Seconds per call of `fn`, captured `calls` times in one CUDA graph (after a warm-up call compiles it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return sorted(times)[len(times) // 2]


def decode_case(batch: int, context: int):
    """Queries, a bf16 cache and its FP8 copy (values already FP8-rounded, so both hold the same numbers), scales,
    block tables (shuffled blocks) and lengths."""
    widest = -(-context // BLOCK)
    num_blocks = batch * widest + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    scales = torch.full((2, KV_HEADS), 1 / 64, device="cuda")
    stored = [quantize(torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g, device="cuda"), scales[i])
              for i in range(2)]
    bf16 = [dequantize(s, scales[i], torch.bfloat16) for i, s in enumerate(stored)]
    q = torch.randn(batch, HEADS, DIM, generator=g, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=g, device="cuda")[: batch * widest].view(batch, widest)
    lens = torch.full((batch,), context, device="cuda")
    return q, bf16, stored, scales, tables, lens


def attention_table(calls: int) -> None:
    from loraplex.layers.kernels.paged_decode import paged_decode  # Triton: CUDA machines only

    print("| batch x context | bf16 cache | fp8 cache | fp8 / bf16 time | bf16 K/V GB/s | fp8 K/V GB/s | max diff |")
    print("|---|---|---|---|---|---|---|")
    for context in CONTEXTS:
        for batch in BATCHES:
            q, bf16, stored, scales, tables, lens = decode_case(batch, context)
            scale = DIM ** -0.5
            run_bf16 = lambda: paged_decode(q, *bf16, tables, lens, scale, max_seq_len=context)  # noqa: E731
            run_fp8 = lambda: paged_decode(q, *stored, tables, lens, scale, max_seq_len=context,  # noqa: E731
                                           kv_scales=scales)
            diff = (run_fp8().float() - run_bf16().float()).abs().max().item()
            bf16_s, fp8_s = graph_time(run_bf16, calls), graph_time(run_fp8, calls)
            values = 2 * batch * context * KV_HEADS * DIM
            print(f"| {batch} x {context} | {bf16_s * 1e6:.1f} us | {fp8_s * 1e6:.1f} us | {fp8_s / bf16_s:.2f} | "
                  f"{values * 2 / bf16_s / 1e9:.0f} | {values / fp8_s / 1e9:.0f} | {diff:.1e} |")
            del q, bf16, stored, tables
            torch.cuda.empty_cache()


def capacity_table(budget_gib: float) -> None:
    from benchmarks.quantization import llama_config
    from benchmarks.random_models import LLAMA_8B_VOCAB

    shape = argparse.Namespace(vocab=LLAMA_8B_VOCAB, hidden=4096, intermediate=14336, layers=LAYERS, heads=HEADS,
                               kv_heads=KV_HEADS)
    config = llama_config(shape)
    budget = int(budget_gib * (1 << 30))
    bf16, fp8 = (budget // kv_bytes_per_token(config, dtype) for dtype in (torch.bfloat16, FP8_KV_DTYPE))
    print(f"\nKV capacity for {budget_gib:g} GiB of cache, 8B shape ({LAYERS} layers): bf16 {bf16:,} tokens, "
          f"fp8 {fp8:,} tokens ({fp8 / bf16:.2f}x)")


def engine_run(kv_cache_dtype: str, requests: int, context: int, new: int = 64) -> tuple[int, float]:
    from benchmarks.random_models import LLAMA_8B_VOCAB, llama_8b
    from loraplex.engine.engine import Engine

    free_gib = torch.cuda.mem_get_info()[0] / (1 << 30)  # what the sizing starts from (the last engine is gone)
    engine = Engine(llama_8b(torch.device("cuda")), EngineConfig(device="cuda", kv_cache_dtype=kv_cache_dtype,
                                                                 max_num_seqs=requests, max_batch_prefill_tokens=8192))
    engine.warm_up()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, LLAMA_8B_VOCAB) for _ in range(context)] for _ in range(requests)]
    running = [engine.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
    while not all(r.output_ids for r in running):
        engine.step()
    torch.cuda.synchronize()
    started, before = time.perf_counter(), sum(len(r.output_ids) for r in running)
    while engine.has_unfinished:
        engine.step()
    torch.cuda.synchronize()
    rate = (sum(len(r.output_ids) for r in running) - before) / (time.perf_counter() - started)
    capacity = engine.kv_capacity_tokens
    del engine, running
    gc.collect()
    torch.cuda.empty_cache()
    return capacity, rate, free_gib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20, help="decode calls per CUDA graph replay")
    p.add_argument("--budget-gib", type=float, default=100.0)
    p.add_argument("--engine", action="store_true", help="also serve a random 8B-shaped model with each cache")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.kv_fp8")) is not None:
        return code
    log(f"FP8 KV cache against bf16 on {torch.cuda.get_device_name()}: the paged decode op, the capacity"
        + (f", then an 8B-shaped engine per cache dtype ({args.requests} x {args.context}; minutes)" if args.engine else "")
        + " (the op: about a minute)")
    print(f"{torch.cuda.get_device_name()}; load average {os.getloadavg()[0]:.2f}; Triton paged decode, one layer")
    log("timing the paged decode op, each cache dtype (the first call compiles the kernel)")
    attention_table(args.calls)
    capacity_table(args.budget_gib)
    if args.engine:
        for name in ("auto", "fp8"):
            log(f"engine, --kv-cache-dtype {name}: loading the random 8B-shaped model, warming up, decoding")
            capacity, rate, free_gib = engine_run(name, args.requests, args.context)
            print(f"engine, 8B shape, --kv-cache-dtype {name} ({free_gib:.1f} GiB free before loading): KV cache "
                  f"{capacity:,} tokens; {args.requests} requests x {args.context} prompt + 64 new: decode "
                  f"{rate:.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
