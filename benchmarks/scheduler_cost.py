"""Host time of one `Scheduler.schedule()` over a full batch of decoding requests (pure Python: the same on any
machine's CPU, and paid once per decode step, in the host's share of an overlapped step).

    python -m benchmarks.scheduler_cost [--running 256] [--waiting 100] [--steps 400]
"""

from __future__ import annotations

import argparse
import time

from loraplex.engine.scheduling.joins import WaitingJoins
from loraplex.engine.requests.request import Request
from loraplex.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from loraplex.params import SamplingParams


def advance(scheduler: Scheduler) -> None:
    """One step, the engine's part played: computed tokens advance, a sampled token is appended."""
    for item in scheduler.schedule().scheduled:
        completes = item.completes_sequence
        item.request.num_computed_tokens += item.num_new_tokens
        if completes:
            item.request.output_ids.append(7)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scheduler_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, default=100, help="queued behind them, not joining (as between joins)")
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args(argv)
    scheduler = Scheduler(SchedulerConfig(num_blocks=(args.running + args.waiting) * 160, block_size=16, max_num_seqs=args.running,
                                          max_batch_prefill_tokens=args.running * 200))
    params = SamplingParams(max_new_tokens=2000)
    for i in range(args.running + args.waiting):
        scheduler.add(Request(f"r{i}", list(range(1, 201)), params, 0, 0.0))
    advance(scheduler)  # every prompt in one step: the rest wait
    scheduler.joins = WaitingJoins(max_waiting_steps=10**9, served_ratio=10.0)  # they keep waiting
    started = time.perf_counter()
    for _ in range(args.steps):
        advance(scheduler)
    per_step = (time.perf_counter() - started) / args.steps
    print(f"{per_step * 1e3:.3f} ms per decode step's schedule (and the bookkeeping of its tokens), "
          f"{len(scheduler.running)} running, {len(scheduler.waiting)} waiting")


if __name__ == "__main__":
    main()
