"""Decode attention: the Triton paged kernel against the torch reference (gather + SDPA), on a GPU:
`python -m benchmarks.paged_decode`.

1. The attention op alone, one layer of Llama-3.1-8B's shape (32 heads, 8 KV heads, head dim 128, bf16), for
   `--rows` decode rows of `--context` tokens each: time per call (CUDA events, median of 50) and the bandwidth it
   reaches reading the rows' keys and values.
2. End to end: a random-weight model of the 8B shape, `--rows` requests of `--context` prompt tokens and 64 new
   tokens, greedy, each backend in turn on the same engine settings: decode tokens/s (steps after every request
   has its first token) and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from benchmarks.progress import needs_cuda, progress
from benchmarks.random_models import LLAMA_8B_VOCAB, llama_8b
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.layers.attention import PagedAttention, TorchAttentionBackend, TritonAttentionBackend
from loraplex.layers.forward_context import AttentionMetadata, DecodeGroup
from loraplex.params import SamplingParams


def time_op(fn, repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def op_case(rows: int, context: int, dtype=torch.bfloat16):
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    widest = -(-context // bs)
    num_blocks = rows * widest + 1
    k = torch.randn(num_blocks, bs, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, heads, dim, device="cuda", dtype=dtype)
    tables = torch.randperm(num_blocks, device="cuda")[: rows * widest].view(rows, widest)
    lens = torch.full((rows,), context, device="cuda")
    group = DecodeGroup(torch.arange(rows, device="cuda"), torch.arange(rows, device="cuda"), lens, context)
    md = AttentionMetadata(slot_mapping=lens, block_tables=tables, seq_lens=[context] * rows,
                           query_start_loc=list(range(rows + 1)), decode_groups=[group], prefill_seqs=[])
    layer = PagedAttention(0, heads, kv_heads, dim, dim ** -0.5)
    kv_bytes = 2 * rows * context * kv_heads * dim * k.element_size()
    return layer, q, k, v, md, kv_bytes


def decode_rate(loaded, backend: str, rows: int, context: int, new: int) -> tuple[float, list[list[int]]]:
    os.environ["LORAPLEX_ATTENTION_BACKEND"] = backend
    engine = Engine(loaded, EngineConfig(device="cuda", max_batch_total_tokens=rows * (context + new + 16),
                                         max_num_seqs=rows, max_batch_prefill_tokens=8192))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, LLAMA_8B_VOCAB) for _ in range(context)] for _ in range(rows)]
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
    while not all(r.output_ids for r in requests):
        engine.step()
    torch.cuda.synchronize()
    started, before = time.perf_counter(), sum(len(r.output_ids) for r in requests)
    while engine.has_unfinished:
        engine.step()
    torch.cuda.synchronize()
    tokens = sum(len(r.output_ids) for r in requests) - before
    return tokens / (time.perf_counter() - started), [r.output_ids for r in requests]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--op-only", action="store_true", help="the attention op alone, no end-to-end run")
    args = p.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.paged_decode")) is not None:
        return code
    log(f"paged decode, torch against triton, on {torch.cuda.get_device_name()}: the op at 3 sizes"
        + ("" if args.op_only else f", then the 8B shape end to end ({args.layers} layers, 4 runs; minutes)"))
    print(f"{torch.cuda.get_device_name()}; load average {os.getloadavg()[0]:.2f}")
    print("| rows x context | torch decode | triton decode | speed-up | triton K/V bandwidth |")
    print("|---|---|---|---|---|")
    for rows, context in ((1, args.context), (args.rows, args.context), (args.rows, 4 * args.context)):
        log(f"the op at {rows} rows x {context} context")
        layer, q, k, v, md, kv_bytes = op_case(rows, context)
        torch_s = time_op(lambda: TorchAttentionBackend()._decode(layer, q, k, v, md, 0))
        triton_s = time_op(lambda: TritonAttentionBackend()._decode(layer, q, k, v, md, 0))
        print(f"| {rows} x {context} | {torch_s * 1e6:.0f} us | {triton_s * 1e6:.0f} us | {torch_s / triton_s:.2f}x | "
              f"{kv_bytes / triton_s / 1e9:.0f} GB/s |")
    if args.op_only:
        return 0
    log(f"building the random 8B-shaped model ({args.layers} layers)")
    loaded = llama_8b(torch.device("cuda"), args.layers)
    # Each backend twice, taking turns (the first run of a process pays for warming up what prefill did not).
    rates = {}
    for backend in ("torch", "triton", "torch", "triton"):
        log(f"end to end, {backend} backend: {args.rows} requests x {args.context} prompt + 64 new")
        rate = decode_rate(loaded, backend, args.rows, args.context, 64)
        if backend not in rates or rate[0] > rates[backend][0]:
            rates[backend] = rate
        print(f"  {backend}: {rate[0]:.0f} tok/s")
    same = sum(a == b for a, b in zip(rates["torch"][1], rates["triton"][1]))
    print(f"end to end, 8B shape ({args.layers} layers), {args.rows} requests x {args.context} prompt + 64 new: decode "
          f"{rates['torch'][0]:.0f} tok/s (torch) vs {rates['triton'][0]:.0f} tok/s (triton), "
          f"{rates['triton'][0] / rates['torch'][0]:.2f}x; {same}/{args.rows} outputs identical (bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
