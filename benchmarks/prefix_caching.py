"""Prefix caching on a shared-system-prompt workload, on against off in one run: `python -m benchmarks.prefix_caching`.

Every request is one long system prompt shared by all, then a short question of its own; requests spread
round-robin over the base model and `--adapters` random adapters (each adapter has its own cache space, so the
system prompt is computed once per adapter). All requests are submitted at once; greedy, EOS ignored.

    python -m benchmarks.prefix_caching                          # CPU: the embedded SmolLM2-135M
    python -m benchmarks.prefix_caching --model 8b --device cuda # a random model of Llama-3.1-8B's shape

Printed per setting (the two take turns `--repeats` times; each keeps its best run): prompt tokens computed
(the rest came from the cache), wall time, output tokens/s, mean time to first token, and the ratios on/off.
Outputs must be identical with and without caching; the benchmark fails otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.progress import progress
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.params import SamplingParams

SYSTEM_TEXT = (
    "You are the support assistant of a bicycle shop. Answer in two sentences at most, name the part involved, "
    "and never invent prices. Opening hours are nine to six on weekdays and ten to four on Saturdays. "
)


@dataclass
class Run:
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    mean_ttft: float
    outputs: list[list[int]]

    def row(self, name: str) -> str:
        return (f"| {name} | {self.prompt_tokens - self.cached_tokens:,} of {self.prompt_tokens:,} | {self.seconds:.2f} s | "
                f"{self.output_tokens / self.seconds:,.1f} | {self.mean_ttft * 1000:,.0f} ms |")


def embedded_engine(config: dict):
    from loraplex.engine.loading import load_model

    loaded = load_model(EngineConfig(device="cpu"))

    def prompts(n: int, system_tokens: int, seed: int) -> list[list[int]]:
        tok = loaded.tokenizer
        system = tok.encode(SYSTEM_TEXT * (1 + system_tokens // len(tok.encode(SYSTEM_TEXT))))[:system_tokens]
        rng = random.Random(seed)
        words = ["chain", "brake", "tyre", "saddle", "gear", "pedal", "light", "lock", "bell", "frame"]
        return [system + tok.encode(f" Question {i}: what about my {rng.choice(words)} and {rng.choice(words)}?")
                for i in range(n)]

    return (lambda **extra: Engine(loaded, EngineConfig(device="cpu", **{"max_batch_prefill_tokens": 8192, **config, **extra}))), prompts, loaded


def random_8b_engine(config: dict, device: torch.device, layers: int):
    from benchmarks.random_models import LLAMA_8B_VOCAB, llama_8b

    loaded = llama_8b(device, layers)

    def prompts(n: int, system_tokens: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        system = [rng.randrange(3, LLAMA_8B_VOCAB) for _ in range(system_tokens)]
        return [system + [rng.randrange(3, LLAMA_8B_VOCAB) for _ in range(24)] for _ in range(n)]

    return (lambda **extra: Engine(loaded, EngineConfig(device=str(device), **{"max_batch_prefill_tokens": 8192, **config, **extra}))), prompts, loaded


def run(engine: Engine, prompts, adapters, params: SamplingParams) -> Run:
    started = time.perf_counter()
    finals = engine.generate(prompts, params, adapters=adapters)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - started
    return Run(
        seconds, sum(f.num_generated_tokens for f in finals), sum(len(p) for p in prompts),
        engine.scheduler.prefix_hits, sum(f.timings["first_token"] for f in finals) / len(finals),
        [f.token_ids for f in finals],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["embedded", "8b"], default="embedded")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=32, help="8b: layers of the random model")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4, help="random rank-16 adapters (0: the base model only)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    log = progress()
    log(f"prefix caching off against on, {args.repeats} run(s) each, then a chunked-prefill control: {args.requests} "
        f"requests x ({args.system_tokens} shared + own) prompt tokens, {args.new_tokens} new, base + {args.adapters} "
        f"adapters, {'the embedded SmolLM2-135M' if args.model == 'embedded' else 'a random 8B-shaped model'} on "
        f"{args.device}" + (" (on a CPU: minutes)" if args.device == "cpu" else ""))

    device = torch.device(args.device)
    config = dict(max_batch_total_tokens=args.requests * (args.system_tokens + 64 + args.new_tokens),
                  max_num_seqs=args.requests)
    log("loading the embedded model" if args.model == "embedded" else f"building the random 8B-shaped model ({args.layers} layers)")
    if args.model == "8b":
        make, make_prompts, loaded = random_8b_engine(config, device, args.layers)
    else:
        make, make_prompts, loaded = embedded_engine(config)
    prompts = make_prompts(args.requests, args.system_tokens, seed=0)
    adapters = [None] * args.requests
    if args.adapters:
        from benchmarks.adapters import AdapterSpec, random_adapter

        log(f"making {args.adapters} random adapters")
        shapes = make(prefix_caching=False).lora.base_shapes
        made = [random_adapter(f"a{i}", shapes, AdapterSpec(), 64, seed=i) for i in range(args.adapters)]
        choices = [None, *made]
        adapters = [choices[i % len(choices)] for i in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    log("warm-up")
    make().generate(prompts[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up, excluded
    best: dict[str, Run] = {}
    for repeat in range(args.repeats):  # the settings take turns; a fresh engine (empty cache) each time
        for name, caching in (("off", False), ("on", True)):
            log(f"timing prefix caching {name} (run {repeat + 1} of {args.repeats})")
            result = run(make(prefix_caching=caching), prompts, adapters, params)
            if name not in best or result.seconds < best[name].seconds:
                best[name] = result
    on, off = best["on"], best["off"]
    identical = sum(a == b for a, b in zip(on.outputs, off.outputs))
    # The control: the same requests without caching, prefilled in 512-token chunks (other row counts, so
    # other GEMM kernels in bf16): how many agree with the plain run when only the batch shapes change.
    log("the control: caching off, prefill in 512-token chunks")
    chunked = run(make(prefix_caching=False, max_batch_prefill_tokens=512), prompts, adapters, params)
    control = sum(a == b for a, b in zip(chunked.outputs, off.outputs))
    # float32 must agree exactly; bf16 GEMMs pick other kernels for other row counts, so near-ties may flip.
    if identical < len(prompts) and loaded.dtype == torch.float32:
        print(f"FAIL: {len(prompts) - identical} outputs differ with prefix caching", file=sys.stderr)
        return 1
    load = os.getloadavg()
    print(f"prefix caching: {args.requests} requests x ({args.system_tokens} shared + ~{len(prompts[0]) - args.system_tokens} own) "
          f"prompt tokens, {args.new_tokens} new, base + {args.adapters} adapters, {loaded.model_id} on {device}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| prefix caching | prompt tokens computed | wall | output tok/s | mean TTFT |")
    print("|---|---|---|---|---|")
    print(off.row("off"))
    print(on.row("on"))
    print(f"on/off: throughput {off.seconds / on.seconds:.2f}x, mean TTFT {on.mean_ttft / off.mean_ttft:.2f}x, "
          f"prompt tokens computed {(on.prompt_tokens - on.cached_tokens) / on.prompt_tokens:.2f}x; "
          f"outputs identical: {identical}/{len(prompts)} (control, caching off but chunked prefill: "
          f"{control}/{len(prompts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
