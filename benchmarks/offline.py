"""Offline throughput benchmark: loraplex against Hugging Face transformers, measured in one run.

    loraplex bench [--workload equal|mixed|adapters|vision|seq2seq|all] [--requests 32] [--one-at-a-time-requests 8]
                   [--prompt-tokens 128] [--new-tokens N] [--model-id ID] [--family t5|bart|both] [--seed 0]
                   [--repeats 1] [--adapters 8] [--adapter-rank 16]
                   [--rotation-adapters 64] [--rotation-slots 8] [--json PATH]

Every system is warmed up once on a small run (excluded), then timed with time.perf_counter on the same prompts.
The figures that matter are the ratios of output tokens/s: on a noisy machine only rates measured in the same run
compare. `--repeats N` lets the systems take turns N times and keeps each one's best time.

`all` (the default) runs equal and mixed. The adapters workload (see benchmarks/adapters.py: loraplex with
adapters against PEFT's mixed-adapter batch and against itself on the base model, plus adapters rotating
through fewer device slots) runs only when named: it times four systems and takes longer than the default set.
So do vision (benchmarks/vision.py) and seq2seq (benchmarks/seq2seq.py: random T5 / BART, with and without
adapters).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from time import perf_counter
from typing import Callable

import torch

from benchmarks.adapters import (
    AdapterResult,
    AdapterSpec,
    PEFTMixed,
    adapter_from_peft,
    bench_adapters,
    format_adapter_result,
    make_peft_model,
    random_adapter,
)
from benchmarks.peers import HFBatched, HFOneAtATime, load_hf_model
from benchmarks.progress import progress
from benchmarks.systems import Loraplex, Measurement, measure
from benchmarks.workload import Workload, equal_workload, mixed_workload, round_robin

# Targets for loraplex's tokens/s as a multiple of each peer's.
TARGETS = {
    "equal": {"batched": 1.0, "one_at_a_time": 5.0},
    "mixed": {"batched": 1.5, "one_at_a_time": 5.0},
}


@dataclass
class WorkloadResult:
    workload: Workload
    ours: Measurement
    batched: Measurement
    one_at_a_time: Measurement
    identical: int  # requests of the one-at-a-time subset whose greedy tokens loraplex matched exactly
    repeats: int = 1  # each figure is the best of this many timed runs

    def ratio(self, peer: Measurement) -> float:
        return self.ours.tokens_per_s / peer.tokens_per_s

    def to_json(self) -> dict:
        peers = {"batched": self.batched, "one_at_a_time": self.one_at_a_time}
        return {
            "description": self.workload.describe(),
            "seed": self.workload.seed,
            "prompt_lengths": [len(p) for p in self.workload.prompts],
            "max_new_tokens": self.workload.max_new_tokens,
            **{key: vars(m) | {"tokens_per_s": m.tokens_per_s} for key, m in [("loraplex", self.ours), *peers.items()]},
            "ratios": {key: self.ratio(m) for key, m in peers.items()},
            "targets": TARGETS.get(self.workload.name, {}),
            "identical_to_one_at_a_time": [self.identical, self.one_at_a_time.requests],
            "repeats": self.repeats,
        }


def bench_workload(
    workload: Workload, ours, batched, one_at_a_time, one_at_a_time_requests: int, repeats: int = 1,
    log: Callable[[str], None] = lambda line: None,
) -> WorkloadResult:
    """Time each system on the workload (one-at-a-time on its first requests); with repeats, the systems take turns
    and each keeps its best time. `log` is told what is timed next."""
    runs = [(ours, workload), (batched, workload), (one_at_a_time, workload.head(one_at_a_time_requests))]

    def timed(system, w: Workload):
        log(f"{workload.name}: timing {system.name} on {w.num_requests} requests")
        return measure(system, w)

    rounds = [[timed(system, w) for system, w in runs] for _ in range(repeats)]
    (ours_m, ours_out), (batched_m, _), (one_m, one_out) = [min(c, key=lambda r: r[0].seconds) for c in zip(*rounds)]
    identical = sum(a == b for a, b in zip(ours_out, one_out))
    return WorkloadResult(workload, ours_m, batched_m, one_m, identical, repeats)


def format_result(result: WorkloadResult, setting: str) -> str:
    w, targets = result.workload, TARGETS.get(result.workload.name, {})
    best_of = f", best of {result.repeats}" if result.repeats > 1 else ""

    def row(m: Measurement, key: str | None = None) -> str:
        line = f"  {m.system:<28}{m.tokens_per_s:>9.1f} tok/s"
        if key is None:
            return line
        ratio, target = result.ratio(m), targets.get(key)
        verdict = "" if target is None else f" (target >= {target:.1f}x, {'met' if ratio >= target else 'NOT met'})"
        return f"{line}   loraplex = {ratio:.2f}x{verdict}"

    lines = [
        f"workload {w.name}: {w.describe()}, greedy, {setting}{best_of}",
        row(result.ours),
        row(result.batched, "batched"),
        row(result.one_at_a_time, "one_at_a_time"),
    ]
    steps = max(w.max_new_tokens)
    if min(w.max_new_tokens) != steps:
        lines.append(
            f"  note: transformers batched generates {steps} tokens for all {w.num_requests} padded rows "
            f"({steps * w.num_requests} tokens); its tok/s counts only the {w.new_tokens} requested ones"
        )
    n = result.one_at_a_time.requests
    if n < w.num_requests:
        lines.append(f"  note: transformers one-at-a-time timed on the first {n} of {w.num_requests} requests; "
                     "its tok/s is from those (a ratio of rates)")
    lines.append(f"  sanity: {result.identical}/{n} requests' greedy tokens identical to transformers one-at-a-time")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="loraplex bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["equal", "mixed", "adapters", "vision", "seq2seq", "embeddings", "all"],
                   default="all",
                   help="all: equal and mixed (the default set); adapters, vision (the example VLM, "
                        "benchmarks/vision.py), seq2seq (random T5 / BART, benchmarks/seq2seq.py) and embeddings "
                        "(benchmarks/embeddings.py) run only when named")
    p.add_argument("--requests", type=int, default=None, help="requests (embeddings: inputs); default 32 (embeddings: 256)")
    p.add_argument("--one-at-a-time-requests", type=int, default=8,
                   help="transformers one-at-a-time is slow: time this many of the requests (default 8)")
    p.add_argument("--model-id", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts, and lengths of the mixed one)")
    p.add_argument("--repeats", type=int, default=1, help="time each system N times, taking turns; keep the best")
    p.add_argument("--adapters", type=int, default=None,
                   help="adapters, seq2seq and embeddings workloads: adapters the requests spread over (0 skips them "
                        "in seq2seq and embeddings); default 8 (embeddings: 4)")
    p.add_argument("--adapter-rank", type=int, default=16,
                   help="adapters and seq2seq workloads: LoRA rank (alpha = 2 x rank)")
    p.add_argument("--rotation-adapters", type=int, default=64,
                   help="adapters workload: adapters (one request each) rotating through --rotation-slots slots")
    p.add_argument("--rotation-slots", type=int, default=8, help="max_active_adapters of the rotation run")
    p.add_argument("--prompt-tokens", type=int, default=128, help="equal workload: tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="equal and vision workloads: new tokens per request (default: equal 32, vision 16)")
    p.add_argument("--vision-model", choices=["llava", "mllama"], default="llava",
                   help="vision workload: the example LLaVA-NeXT or the example Mllama")
    p.add_argument("--family", choices=["t5", "bart", "both"], default="both", help="seq2seq workload: model family")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    embeddings = args.workload == "embeddings"
    args.requests = args.requests if args.requests is not None else 256 if embeddings else 32
    args.adapters = args.adapters if args.adapters is not None else 4 if embeddings else 8
    return args


def missing_peft(args: argparse.Namespace) -> str | None:
    """Why this run cannot start (the workload compares against PEFT, which `make install` does not bring), or None."""
    needs = args.workload == "adapters" or (args.workload == "seq2seq" and args.adapters > 0)
    if not needs or importlib.util.find_spec("peft") is not None:
        return None
    return (f"the {args.workload} workload compares loraplex's adapters against PEFT's, which is not installed: "
            "`.venv/bin/pip install peft` (or `make install-test`)"
            + (", or run it without adapters: --adapters 0" if args.workload == "seq2seq" else ""))


HOW_TO_READ = """How to read this: `loraplex = Nx` is loraplex's output tokens/s over the peer's, on the same prompts in this
run (only ratios from one run compare: the machine is shared). `transformers batched` runs all requests as one
padded batch of model.generate (a static batch: good when requests are alike, wasteful when their lengths differ:
the mixed workload); `transformers one-at-a-time` generates each request alone, as a server without batching does.
The targets are the project's goals on a 2-core CPU; a loaded machine moves every ratio (--repeats 3 keeps each
system's best of three turns). `sanity` counts requests whose greedy tokens equal transformers' exactly."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := missing_peft(args)) is not None:
        print(f"loraplex bench: {why}", file=sys.stderr)
        return 2
    if args.workload == "vision":  # its own model (the example VLM) and peer
        from benchmarks.vision import bench_vision, format_vision

        new_tokens = 16 if args.new_tokens is None else args.new_tokens
        result = bench_vision(args.requests, new_tokens, args.repeats, args.seed, args.vision_model)
        print(format_vision(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workloads": {"vision": result}}, f, indent=2)
        return 0
    if args.workload == "seq2seq":  # its own random models (T5, BART) and peers
        from benchmarks.seq2seq import main as seq2seq_main

        return seq2seq_main(args)
    from loraplex.checkpoints.sources import resolve_model
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine
    from loraplex.engine.loading import load_model

    started = perf_counter()
    log = progress(started)
    log("loading the model")
    config = EngineConfig(model_id=args.model_id)
    loaded = load_model(config)
    engine = Engine(loaded, config)
    hf_path = resolve_model(args.model_id).path
    hf_tok = engine.tokenizer.hf
    pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    names = ["equal", "mixed"] if args.workload == "all" else [args.workload]
    ours = Loraplex(engine)

    vocab, special = engine.model_config.vocab_size, hf_tok.all_special_ids
    workloads = {
        "equal": lambda: equal_workload(args.requests, vocab, special, prompt_len=args.prompt_tokens,
                                        new_tokens=32 if args.new_tokens is None else args.new_tokens, seed=args.seed),
        "mixed": lambda: mixed_workload(args.requests, vocab, special, seed=args.seed),
    }
    setting = f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    print(f"model {engine.model_id}; torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} (the machine is shared: read the ratios)", flush=True)

    warmup = equal_workload(2, vocab, special, prompt_len=16, new_tokens=4, seed=args.seed + 1, name="warmup")
    log("warming up loraplex")
    ours.run(warmup)
    results = {}
    plain = [n for n in names if n in workloads]
    if plain:
        log("loading transformers' copy of the model and warming it up")
        hf_model = load_hf_model(hf_path)
        peers = (HFBatched(hf_model, pad_id), HFOneAtATime(hf_model, pad_id))
        for system in peers:
            system.run(warmup)
        for name in plain:
            results[name] = bench_workload(workloads[name](), ours, *peers, args.one_at_a_time_requests, args.repeats,
                                           log)
            print(format_result(results[name], setting), flush=True)
    if "embeddings" in names:
        from benchmarks.embeddings import bench_embeddings, format_embeddings

        log("the embeddings workload: transformers' copy of the model")
        results["embeddings"] = bench_embeddings(engine, load_hf_model(hf_path), pad_id, args, log)
        print(format_embeddings(results["embeddings"], setting), flush=True)
    if "adapters" in names:
        log("the adapters workload: PEFT's model and the adapters")
        result = run_adapter_workload(args, loaded, engine, ours, load_hf_model(hf_path), pad_id, warmup, setting)
        results["adapters"] = result
        print(format_adapter_result(result, setting), flush=True)
    print(f"total benchmark time {perf_counter() - started:.0f}s (loading and warm-up included), "
          f"load average {os.getloadavg()[0]:.1f}")
    if plain:
        print(HOW_TO_READ)

    if args.json:
        figures = {"model_id": engine.model_id, "setting": setting, "torch_num_threads": torch.get_num_threads(),
                   "workloads": {name: r if isinstance(r, dict) else r.to_json() for name, r in results.items()}}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def run_adapter_workload(args, loaded, engine, ours_base: Loraplex, hf_model, pad_id: int, warmup: Workload,
                         setting: str) -> AdapterResult:
    """The adapters workload on `engine` (and a second engine over the same model for the rotation run)."""
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    spec = AdapterSpec(rank=args.adapter_rank, alpha=2.0 * args.adapter_rank)
    max_rank = max(engine.config.max_lora_rank, spec.rank)
    if engine.config.max_active_adapters < args.adapters:
        raise SystemExit(f"--adapters {args.adapters} is above the engine's max_active_adapters")
    shapes = engine.lora.base_shapes
    names = [f"adapter-{i}" for i in range(args.adapters)]
    peft_model = make_peft_model(hf_model, names, spec, seed=args.seed)
    adapters = {name: adapter_from_peft(peft_model, name, shapes, max_rank) for name in names}
    rotation_ids = [f"rotation-{i}" for i in range(args.rotation_adapters)]
    rotation_adapters = {
        name: random_adapter(name, shapes, spec, max_rank, seed=args.seed * 1_000_003 + 1 + i)
        for i, name in enumerate(rotation_ids)
    }
    vocab, special = engine.model_config.vocab_size, engine.tokenizer.hf.all_special_ids
    workload = round_robin(equal_workload(args.requests, vocab, special, seed=args.seed), names, name="adapters")
    rotation_workload = round_robin(
        equal_workload(args.rotation_adapters, vocab, special, seed=args.seed), rotation_ids, name="rotation"
    )
    rotation_tokens = sum(len(p) + n for p, n in zip(rotation_workload.prompts, rotation_workload.max_new_tokens))
    rotation_config = EngineConfig(  # KV cache for every rotation request at once
        model_id=args.model_id, max_active_adapters=args.rotation_slots, max_lora_rank=max_rank,
        max_batch_total_tokens=rotation_tokens,
    )
    systems = (
        Loraplex(engine, adapters, name=f"loraplex, {args.adapters} adapters"),
        ours_base,
        PEFTMixed(peft_model, pad_id),
        Loraplex(Engine(loaded, rotation_config), rotation_adapters, name="loraplex rotating adapters"),
    )
    # Warm-up: one short request per adapter, so the timed runs of (1) serve resident adapters (as PEFT's are);
    # the rotation run installs adapters in every timed run anyway.
    adapter_warmup = round_robin(
        equal_workload(len(names), vocab, special, prompt_len=16, new_tokens=4, seed=args.seed + 1), names
    )
    for system, w in zip(systems, (adapter_warmup, warmup, adapter_warmup, round_robin(warmup, rotation_ids[:2]))):
        system.run(w)
    return bench_adapters(workload, rotation_workload, *systems, spec, args.rotation_slots, args.repeats,
                          log=lambda line: print(line, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())
