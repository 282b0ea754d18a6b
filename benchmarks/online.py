"""An S-LoRA-style online workload driven straight through loraplex's synchronous Engine.

Requests arrive as a Poisson process (`rate` requests/s, exponential gaps), each on an adapter drawn from a
power law over `num_adapters` adapters (adapter k of 1..N with probability proportional to 1 / k^alpha; alpha 1 is
Zipf's law, S-LoRA's skewed setting), with prompt and output lengths drawn uniformly from inclusive ranges. EOS is
ignored and decoding is greedy, so every request generates exactly its output length.

The driver is one loop: add every request whose arrival time (time.perf_counter, relative to the run's start) has
passed, then `engine.step()`; when nothing is in flight it sleeps until the next arrival. Per request it records
the arrival (the scheduled one: a request that arrives during a long step waits, and that wait counts), the time
its first token came out of a step, and the time it finished. TTFT = first token - arrival; TPOT = (finish -
first token) / (output tokens - 1), for requests of two tokens or more; e2e = finish - arrival.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from benchmarks.workload import random_prompts
from loraplex.lora.adapter import LoraAdapter
from loraplex.params import SamplingParams


@dataclass(frozen=True)
class OnlineWorkload:
    arrivals: list[float]  # seconds after the start, non-decreasing
    prompts: list[list[int]]
    max_new_tokens: list[int]
    adapter_ranks: list[int]  # per request: 0-based popularity rank of its adapter (0: the most popular)
    rate: float
    zipf_alpha: float
    num_adapters: int
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def describe(self) -> str:
        p, o = [len(x) for x in self.prompts], self.max_new_tokens
        used = len(set(self.adapter_ranks))
        return (f"{self.num_requests} requests, Poisson {self.rate:g} req/s over {self.arrivals[-1]:.1f}s, "
                f"prompt {min(p)}..{max(p)} / output {min(o)}..{max(o)} tokens, adapters power-law "
                f"(alpha {self.zipf_alpha:g}) over {self.num_adapters} ({used} drawn), seed {self.seed}")


def online_workload(
    vocab_size: int, rate: float, num_adapters: int, zipf_alpha: float = 1.0, duration_s: float | None = 60.0,
    num_requests: int | None = None, prompt_lens: tuple[int, int] = (8, 512), output_lens: tuple[int, int] = (8, 256),
    special_ids=(), seed: int = 0,
) -> OnlineWorkload:
    """Arrivals until `duration_s`, or exactly `num_requests` of them when given."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if num_requests is not None and len(arrivals) >= num_requests:
            break
        if num_requests is None and t > duration_s:
            break
        arrivals.append(t)
    arrivals = arrivals or [0.0]
    n = len(arrivals)
    weights = [1.0 / (k + 1) ** zipf_alpha for k in range(num_adapters)]
    ranks = rng.choices(range(num_adapters), weights=weights, k=n)
    lengths = [rng.randint(*prompt_lens) for _ in range(n)]
    outputs = [rng.randint(*output_lens) for _ in range(n)]
    prompts = random_prompts(lengths, vocab_size, special_ids, rng)
    return OnlineWorkload(arrivals, prompts, outputs, ranks, rate, zipf_alpha, num_adapters, seed)


@dataclass
class RequestTimes:
    arrival: float
    first_token: float
    finish: float
    output_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.finish - self.first_token) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class OnlineResult:
    system: str
    workload: OnlineWorkload
    requests: list[RequestTimes]
    makespan_s: float  # first arrival to last finish
    max_running: int  # the most requests that got a token in one step
    # engine.step() calls by kind, (count, seconds of wall time): "launched" left its step in flight (a decode step,
    # overlapped with the next call), "run" ran its step at once (prompts in it, or not launchable).
    steps: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.makespan_s

    def latency(self) -> dict[str, float]:
        ttft = [r.ttft for r in self.requests]
        tpot = [r.tpot for r in self.requests if r.tpot is not None]
        e2e = [r.e2e for r in self.requests]
        return {f"{name}_p{q}": percentile(values, q) for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e))
                for q in (50, 99)}

    def to_json(self) -> dict:
        return {"system": self.system, "description": self.workload.describe(), "requests": len(self.requests),
                "output_tokens": self.output_tokens, "makespan_s": self.makespan_s,
                "tokens_per_s": self.tokens_per_s, "requests_per_s": self.requests_per_s,
                "max_running": self.max_running, **self.latency(),
                "steps": {kind: {"count": n, "seconds": t} for kind, (n, t) in self.steps.items()}}

    def describe_steps(self) -> str:
        parts = [f"{n} {kind} ({t:.2f}s, {t / n * 1e3:.1f} ms each)" for kind, (n, t) in self.steps.items() if n]
        return f"{self.system}: steps " + ", ".join(parts)


def run_online(
    engine, workload: OnlineWorkload, adapters: list[LoraAdapter] | None, system: str,
    clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
) -> OnlineResult:
    """Serve the workload on `engine` (request i on adapters[workload.adapter_ranks[i]], or the base model when
    `adapters` is None) in real time; return every request's times."""
    n = workload.num_requests
    arrival_of, first, finish, count = {}, {}, {}, {}
    next_i, max_running = 0, 0
    steps = {"launched": [0, 0.0], "run": [0, 0.0]}
    start = clock()
    while len(finish) < n:
        now = clock() - start
        while next_i < n and workload.arrivals[next_i] <= now:
            adapter = None if adapters is None else adapters[workload.adapter_ranks[next_i]]
            params = SamplingParams(max_new_tokens=workload.max_new_tokens[next_i], ignore_eos=True)
            request = engine.add_request(workload.prompts[next_i], params, adapter=adapter)
            arrival_of[request.request_id] = workload.arrivals[next_i]
            next_i += 1
        if not engine.has_unfinished:
            sleep(max(0.0, workload.arrivals[next_i] - (clock() - start)))
            continue
        before = clock()
        outputs = engine.step()
        after = clock()
        done = after - start
        kind = steps["launched" if engine.step_in_flight else "run"]
        kind[0] += 1
        kind[1] += after - before
        running = {o.request_id for o in outputs}
        max_running = max(max_running, len(running))
        for out in outputs:
            rid = out.request_id
            first.setdefault(rid, done)
            count[rid] = count.get(rid, 0) + (out.token is not None)
            if out.finished:
                if out.error:
                    raise RuntimeError(f"{system}: request {rid} failed: {out.error}")
                finish[rid] = done
    times = [RequestTimes(arrival_of[r], first[r], finish[r], count[r]) for r in arrival_of]
    expected = sorted(workload.max_new_tokens)
    if sorted(t.output_tokens for t in times) != expected:
        raise RuntimeError(f"{system}: output token counts differ from the workload's")
    makespan = max(t.finish for t in times) - workload.arrivals[0]
    return OnlineResult(system, workload, times, makespan, max_running, {k: (n, t) for k, (n, t) in steps.items()})


def round_ratios(rounds: list[list[OnlineResult]]) -> list[list[float]]:
    """Per other system, the first system's output tok/s over its, in each round (the systems' runs taken in
    turns). A ratio of runs close in time is steadier than one of each system's best run when the host's speed
    drifts between rounds; the median over rounds is the figure of record."""
    return [[r[0].tokens_per_s / r[k].tokens_per_s for r in rounds] for k in range(1, len(rounds[0]))]


def format_online(results: list[OnlineResult], setting: str, rounds: list[list[OnlineResult]] = ()) -> str:
    w = results[0].workload
    lines = [
        f"online (S-LoRA-style): {w.describe()}; greedy, EOS ignored; {setting}",
        "",
        "| system | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | e2e p50 s "
        "| e2e p99 s | most in a step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lat = r.latency()
        lines.append(
            f"| {r.system} | {r.tokens_per_s:.1f} | {r.requests_per_s:.2f} | {lat['ttft_p50'] * 1e3:.1f} | "
            f"{lat['ttft_p99'] * 1e3:.1f} | {lat['tpot_p50'] * 1e3:.2f} | {lat['tpot_p99'] * 1e3:.2f} | "
            f"{lat['e2e_p50']:.2f} | {lat['e2e_p99']:.2f} | {r.max_running} |"
        )
    first = results[0]
    lines += ["", *(f"{first.system}: {first.tokens_per_s / r.tokens_per_s:.2f}x the output tok/s of {r.system}"
                    for r in results[1:])]
    if len(rounds) > 1:
        for other, ratios in zip(results[1:], round_ratios(rounds)):
            lines.append(f"{first.system} / {other.system}, round by round: "
                         f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}x)")
    lines += ["", *(r.describe_steps() for r in results)]
    return "\n".join(lines)

