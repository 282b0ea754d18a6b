"""Offline throughput benchmark: loraplex against Hugging Face transformers, measured in one run.

    loraplex bench [--workload equal|mixed|all] [--requests 32] [--one-at-a-time-requests 8] [--model-id ID] [--seed 0]
                   [--repeats 1] [--json PATH]

Every system is warmed up once on a small run (excluded), then timed with time.perf_counter on the same prompts.
The figures that matter are the ratios of output tokens/s: on a noisy machine only rates measured in the same run
compare. `--repeats N` lets the systems take turns N times and keeps each one's best time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from time import perf_counter

import torch

from benchmarks.peers import HFBatched, HFOneAtATime, load_hf_model
from benchmarks.workload import Workload, equal_workload, mixed_workload
from loraplex.params import SamplingParams

# Targets for loraplex's tokens/s as a multiple of each peer's.
TARGETS = {
    "equal": {"batched": 1.0, "one_at_a_time": 5.0},
    "mixed": {"batched": 1.5, "one_at_a_time": 5.0},
}


class Loraplex:
    """All requests submitted at once to one engine; each with its own max_new_tokens, EOS ignored, greedy."""

    name = "loraplex"

    def __init__(self, engine) -> None:
        self.engine = engine

    def run(self, workload: Workload) -> list[list[int]]:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.max_new_tokens]
        return [out.token_ids for out in self.engine.generate(workload.prompts, params)]


@dataclass
class Measurement:
    system: str
    seconds: float
    requests: int
    tokens: int  # requested (useful) output tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def measure(system, workload: Workload) -> tuple[Measurement, list[list[int]]]:
    start = perf_counter()
    outputs = system.run(workload)
    seconds = perf_counter() - start
    counts = [len(o) for o in outputs]
    if counts != workload.max_new_tokens:
        raise RuntimeError(f"{system.name} generated {counts} tokens; asked for {workload.max_new_tokens}")
    return Measurement(system.name, seconds, workload.num_requests, sum(counts)), outputs


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
    workload: Workload, ours, batched, one_at_a_time, one_at_a_time_requests: int, repeats: int = 1
) -> WorkloadResult:
    """Time each system on the workload (one-at-a-time on its first requests); with repeats, the systems take turns
    and each keeps its best time."""
    runs = [(ours, workload), (batched, workload), (one_at_a_time, workload.head(one_at_a_time_requests))]
    rounds = [[measure(system, w) for system, w in runs] for _ in range(repeats)]
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
    p.add_argument("--workload", choices=["equal", "mixed", "all"], default="all")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--one-at-a-time-requests", type=int, default=8,
                   help="transformers one-at-a-time is slow: time this many of the requests (default 8)")
    p.add_argument("--model-id", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts, and lengths of the mixed one)")
    p.add_argument("--repeats", type=int, default=1, help="time each system N times, taking turns; keep the best")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine
    from loraplex.weights import resolve_model

    started = perf_counter()
    engine = Engine.from_config(EngineConfig(model_id=args.model_id))
    hf_model = load_hf_model(resolve_model(args.model_id).path)
    hf_tok = engine.tokenizer.hf
    pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    systems = (Loraplex(engine), HFBatched(hf_model, pad_id), HFOneAtATime(hf_model, pad_id))

    vocab, special = engine.model_config.vocab_size, hf_tok.all_special_ids
    workloads = {
        "equal": lambda: equal_workload(args.requests, vocab, special, seed=args.seed),
        "mixed": lambda: mixed_workload(args.requests, vocab, special, seed=args.seed),
    }
    names = list(workloads) if args.workload == "all" else [args.workload]
    setting = f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    print(f"model {engine.model_id}; torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} (the machine is shared: read the ratios)", flush=True)

    warmup = equal_workload(2, vocab, special, prompt_len=16, new_tokens=4, seed=args.seed + 1, name="warmup")
    for system in systems:
        system.run(warmup)

    results = {}
    for name in names:
        results[name] = bench_workload(workloads[name](), *systems, args.one_at_a_time_requests, args.repeats)
        print(format_result(results[name], setting), flush=True)
    print(f"total benchmark time {perf_counter() - started:.0f}s (loading and warm-up included), "
          f"load average {os.getloadavg()[0]:.1f}")

    if args.json:
        figures = {"model_id": engine.model_id, "setting": setting, "torch_num_threads": torch.get_num_threads(),
                   "workloads": {name: r.to_json() for name, r in results.items()}}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
