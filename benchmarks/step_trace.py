"""Where engine steps' wall time goes: a window of a run's `engine.step()` calls traced by torch's profiler, summed
per step kind. CUDA only.

The profiler records CUDA activity only: the runtime and driver calls the host makes (with how long each took on
the host) and the kernels and copies they put on the device. It does not record the host's own ops, so the host
runs nearly as fast as untraced, and time it spends waiting for the device (a synchronising copy, a stream
synchronize) shows as a long call instead of being hidden behind a slowed host, as under cProfile. Each traced step
starts with a marker kernel (`torch.cuda._sleep`, named spin_kernel), whose launch on the host is the step's
boundary in the trace.

Per step kind ("run": prompts in the step, run at once; "launched": a decode step left in flight), per step on
average: the host's wall time, the time inside its CUDA calls by name (waits stand out), the device time of the
kernels the step launched by kind (benchmarks/step_kernels.py's kinds; LoRA split into tile and row kernels), and
how much of the step's wall time the device was busy.
"""

from __future__ import annotations

import bisect
import gc
import gzip
import json
import operator
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from benchmarks.step_kernels import kind_of

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# Host phases of a step, timed in every step of the run: (object path from the engine, method, label).
PHASES = (
    ("scheduler", "schedule", "schedule"), ("", "_install", "install"), ("runner.batches", "build", "batch"),
    ("runner.lora_planner", "plan", "lora plan"), ("runner.model_call", "forward", "forward"), ("runner", "_sample", "sample"),
    ("runner", "launch", "launch"), ("runner", "land", "land"), ("", "_update", "update"),
)


class StepTracer:
    """While entered: every step's host time by phase (PHASES) and in Python's garbage collector, summed by step
    kind (`phase_ms`, `phase_steps`); and the engine's steps [first, first + count) run under torch's profiler, the
    trace written to `path` (gzipped JSON) when the window closes, each traced step's kind in `kinds`."""

    def __init__(self, engine, first: int, count: int, path: str) -> None:
        self.engine, self.first, self.count, self.path = engine, first, count, path
        self.kinds: list[str] = []
        self.phase_ms: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # kind -> phase -> ms
        self.phase_steps: dict[str, int] = defaultdict(int)
        self._current: dict[str, float] = defaultdict(float)
        self._wrapped: list[tuple[object, str, object | None]] = []
        self._gc_started = 0.0
        self._calls = 0
        self._profiler = None

    def __enter__(self) -> "StepTracer":
        self._wrap(self.engine, "step", None)
        for path, method, label in PHASES:
            owner = operator.attrgetter(path)(self.engine) if path else self.engine
            self._wrap(owner, method, label)
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        for owner, method, own in reversed(self._wrapped):
            if own is None:
                delattr(owner, method)  # the class's method shows again
            else:
                setattr(owner, method, own)
        self._close()

    def _wrap(self, owner, method: str, label: str | None) -> None:
        original = getattr(owner, method)
        own = vars(owner).get(method)  # an instance attribute already (another wrapper): put back at the end
        if label is None:
            timed = lambda *a, **k: self._traced_step(original)  # noqa: E731
        else:
            def timed(*a, **k):
                started = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    self._current[label] += (time.perf_counter() - started) * 1e3
        setattr(owner, method, timed)
        self._wrapped.append((owner, method, own))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._current[f"gc (generation {info['generation']})"] += (time.perf_counter() - self._gc_started) * 1e3

    def _traced_step(self, step):
        index, self._calls = self._calls, self._calls + 1
        if index == self.first:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.start()
        traced = self._profiler is not None
        if traced:
            torch.cuda._sleep(1)
        self._current = defaultdict(float)
        started = time.perf_counter()
        outputs = step()
        self._current["step"] = (time.perf_counter() - started) * 1e3
        kind = "launched" if self.engine.step_in_flight else "run"
        self.phase_steps[kind] += 1
        for label, ms in self._current.items():
            self.phase_ms[kind][label] += ms
        if traced:
            self.kinds.append(kind)
            if len(self.kinds) == self.count:
                self._close()
        return outputs

    def _close(self) -> None:
        if self._profiler is None:
            return
        torch.cuda._sleep(1)  # the last step's end
        torch.cuda.synchronize()
        self._profiler.stop()
        self._profiler.export_chrome_trace(self.path)
        self._profiler = None

    def describe_phases(self) -> list[str]:
        lines = []
        for kind in ("run", "launched"):
            n = self.phase_steps.get(kind)
            if n:
                ms = self.phase_ms[kind]
                parts = ", ".join(f"{label} {v / n:.2f}" for label, v in ms.items() if label != "step")
                lines.append(f"  {kind}: {n} steps, {ms['step'] / n:.1f} ms each; by phase: {parts}")
        return lines


@dataclass
class KindSummary:
    steps: int = 0
    wall_ms: float = 0.0
    busy_ms: float = 0.0  # device busy (any kernel or copy) within the steps' wall time
    calls: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))  # name -> [n, ms]
    device_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def describe(self, kind: str, top: int = 8) -> list[str]:
        n = self.steps
        lines = [f"  {kind}: {n} steps, {self.wall_ms / n:.1f} ms each on the host; device busy {self.busy_ms / n:.1f} "
                 f"ms of it ({self.busy_ms / self.wall_ms:.0%})"]
        device = sorted(self.device_ms.items(), key=lambda kv: -kv[1])
        lines.append("    device ms per step: " + ", ".join(f"{k} {ms / n:.2f}" for k, ms in device))
        in_calls = sum(ms for _, ms in self.calls.values())
        lines.append(f"    host ms per step in CUDA calls: {in_calls / n:.2f}; outside them (Python, torch): "
                     f"{(self.wall_ms - in_calls) / n:.2f}")
        for name, (count, ms) in sorted(self.calls.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"      {name}: {count / n:.1f} calls, {ms / n:.2f} ms ({ms / count * 1e3:.1f} us each)")
        return lines


def device_kind(name: str) -> str:
    """step_kernels' kind, LoRA split into the tile (SGMV) and per-row (BGMV) kernels."""
    kind = kind_of(name)
    if kind == "lora":
        return "lora tiles" if "tile_" in name else "lora rows"
    return kind


def summarise(trace: dict, kinds: list[str]) -> dict[str, KindSummary]:
    """Per step kind, the sums over the traced steps (see the module's notes)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"])
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    marker_ids = {e["args"].get("correlation") for e in device if MARKER in e["name"]}
    bounds = [e["ts"] for e in host if e["args"].get("correlation") in marker_ids]
    assert len(bounds) == len(kinds) + 1, f"{len(bounds)} markers for {len(kinds)} steps"
    by_correlation = defaultdict(list)
    for e in device:
        if MARKER not in e["name"]:
            by_correlation[e["args"].get("correlation")].append(e)
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in device if MARKER not in e["name"])
    longest = max((hi - lo for lo, hi in busy), default=0.0)
    out: dict[str, KindSummary] = defaultdict(KindSummary)
    for kind, start, end in zip(kinds, bounds, bounds[1:]):
        s = out[kind]
        s.steps += 1
        s.wall_ms += (end - start) / 1e3
        s.busy_ms += _covered(busy, start, end, longest) / 1e3
    for e in host:  # each call in the step whose window holds it
        step = bisect.bisect_right(bounds, e["ts"]) - 1
        if not 0 <= step < len(kinds):
            continue
        s = out[kinds[step]]
        s.calls[e["name"]][0] += 1
        s.calls[e["name"]][1] += e["dur"] / 1e3
        for launched in by_correlation.get(e["args"].get("correlation"), ()):
            s.device_ms[device_kind(launched["name"])] += launched["dur"] / 1e3
    return dict(out)


def _covered(intervals: list[tuple[float, float]], start: float, end: float, longest: float) -> float:
    """Length of [start, end) covered by the union of `intervals` (sorted by start, none longer than `longest`)."""
    first = bisect.bisect_left(intervals, (start - longest,))
    total, reach = 0.0, start
    for lo, hi in intervals[first:]:
        if lo >= end:
            break
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def describe_trace(tracer: StepTracer, title: str) -> str:
    """The traced window's summary and every step's host phases."""
    with gzip.open(tracer.path, "rt") as f:
        trace = json.load(f)
    summary = summarise(trace, tracer.kinds)
    lines = [f"{title}: steps {tracer.first}..{tracer.first + tracer.count - 1} traced by torch's profiler (CUDA "
             "activity only), per step on average"]
    for kind in ("run", "launched"):
        if kind in summary:
            lines += summary[kind].describe(kind)
    lines += [f"{title}: every step's host time by phase, ms per step on average"] + tracer.describe_phases()
    return "\n".join(lines)
