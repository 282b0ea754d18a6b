"""LoRAX's batch metrics, recorded on the engine thread as each step runs.

Per step (`Engine.step`, plain or overlapped): its method (`prefill` when any of its rows computes prompt tokens,
else `decode`), whether it succeeded (a step that raises, or whose forward raised and was contained, fails), its
seconds (successful steps, as LoRAX times them), and how many requests it ran for the first time (LoRAX's
`lorax_batch_next_size`: the size of each new batch of queued requests). Counts, bucket counts and sums are plain
ints and floats; after each step the recorder publishes a frozen snapshot (one reference, swapped whole), which
the stats snapshot (engine/stats.py) hands to the server's /metrics.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

METHODS = ("prefill", "decode")
# Upper bounds (Prometheus `le`, inclusive); one more bucket above the last: +Inf.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
NEXT_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))  # 1, 2, 4, ... 1024 requests


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...] = ()  # per bucket, not cumulative: len(bounds) + 1 (the last: above every bound)
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), the last bound +Inf, as Prometheus writes a histogram."""
        counts = self.counts or (0,) * (len(self.bounds) + 1)
        totals, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), counts):
            running += count
            totals.append((bound, running))
        return totals


@dataclass(frozen=True)
class StepMetricsSnapshot:
    """Steps by method: run, succeeded, failed; successful steps' seconds; requests started per step that
    started any."""

    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    failure: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    duration: dict[str, HistogramSnapshot] = field(
        default_factory=lambda: {m: HistogramSnapshot(DURATION_BUCKETS) for m in METHODS})
    next_size: HistogramSnapshot = HistogramSnapshot(NEXT_SIZE_BUCKETS)


class _Buckets:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


class StepMetrics:
    """The recorder. The engine wraps each step in `step()`, calls `begin` with what the step runs once its
    adapters are installed (a step that runs nothing is not counted), and `failed` when its forward raised."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.count, self.failure = dict.fromkeys(METHODS, 0), dict.fromkeys(METHODS, 0)
        self.duration = {m: _Buckets(DURATION_BUCKETS) for m in METHODS}
        self.next_size = _Buckets(NEXT_SIZE_BUCKETS)
        self.snapshot = StepMetricsSnapshot()  # read from any thread
        self._method: str | None = None
        self._failed = False
        self._started = 0.0

    def step(self) -> "StepMetrics":
        return self

    def __enter__(self) -> None:
        self._method, self._failed, self._started = None, False, self.clock()

    def __exit__(self, kind, error, traceback) -> None:
        method, self._method = self._method, None
        if method is None:  # nothing ran (or it raised before anything was scheduled)
            return
        self.count[method] += 1
        if kind is not None or self._failed:
            self.failure[method] += 1
        else:
            self.duration[method].observe(self.clock() - self._started)
        self._publish()

    def begin(self, scheduled: Sequence) -> None:
        """The step runs `scheduled` (ScheduledRequests, before their first steps are stamped; none: the step runs
        nothing, as when every adapter install failed, and is not counted)."""
        requests = [item.request for item in scheduled]
        if not requests:
            return
        prefill = any(r.num_computed_tokens < len(r.prompt_ids) for r in requests)
        self._method = "prefill" if prefill else "decode"
        started = sum(r.first_scheduled_time is None for r in requests)
        if started:
            self.next_size.observe(started)

    def failed(self) -> None:
        """The step's forward raised (its failure was contained: engine/containment.py)."""
        self._failed = True

    def _publish(self) -> None:
        count, failure = dict(self.count), dict(self.failure)
        self.snapshot = StepMetricsSnapshot(
            count, {m: count[m] - failure[m] for m in METHODS}, failure,
            {m: buckets.snapshot() for m, buckets in self.duration.items()}, self.next_size.snapshot(),
        )
