"""loraplex as a benchmarked system, and the timing every benchmark applies to any system on a workload.

`Loraplex` submits all of a workload's requests at once to one engine; `measure` times any system's `run` (this
one, the transformers and PEFT peers of benchmarks/peers.py and benchmarks/adapters.py) and checks that it
generated exactly the tokens asked for. The offline benchmark (benchmarks/offline.py), its encoder-decoder
workload (benchmarks/seq2seq.py) and the GPU benchmark (benchmarks/gpu.py) share them; this module imports none
of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from time import perf_counter

from benchmarks.workload import Workload
from loraplex.lora.adapter import LoraAdapter
from loraplex.params import SamplingParams

MAX_IDLE_STEPS = 1000  # engine steps in a row that schedule nothing: the run is stuck


class Loraplex:
    """All requests submitted at once to one engine; each with its own max_new_tokens, EOS ignored, greedy.

    With `adapters` (adapter id -> LoraAdapter), each request runs on its workload's adapter. `stats` describes
    the last run: engine steps, slot installs (SchedulerOutput.installs) and the most requests in one step.
    """

    def __init__(self, engine, adapters: Mapping[str, LoraAdapter] | None = None, name: str = "loraplex") -> None:
        self.engine, self.adapters, self.name = engine, adapters, name
        self.stats: dict[str, int] = {}
        self._idle = 0
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._observed_schedule  # this engine only: count what each step does

    def _observed_schedule(self):
        plan = self._schedule()
        self.stats["steps"] = self.stats.get("steps", 0) + bool(plan.scheduled)
        self.stats["installs"] = self.stats.get("installs", 0) + len(plan.installs)
        self.stats["max_running"] = max(self.stats.get("max_running", 0), len(plan.scheduled))
        self._idle = 0 if plan.scheduled else self._idle + 1
        return plan

    def run(self, workload: Workload) -> list[list[int]]:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in workload.max_new_tokens]
        adapters = [None] * workload.num_requests
        if self.adapters is not None and workload.adapter_ids is not None:
            adapters = [self.adapters[a] for a in workload.adapter_ids]
        self.stats, self._idle = {}, 0
        engine = self.engine
        requests = [engine.add_request(p, sp, adapter=a) for p, sp, a in zip(workload.prompts, params, adapters)]
        finals = {}
        while engine.has_unfinished:  # Engine.generate's loop, failing instead of spinning if nothing can run
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
            if self._idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"{self.name}: no request could be scheduled for {MAX_IDLE_STEPS} steps; "
                                   f"{len(requests) - len(finals)} of {len(requests)} unfinished")
        return [finals[r.request_id].token_ids for r in requests]


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
