"""Progress lines for the benchmarks: `[  12s] what` on stderr, flushed, so that a run says what it is doing
within seconds of its start and before each long phase (stdout keeps only the figures).

    from benchmarks.progress import needs_cuda, progress

    log = progress()
    log("speculative decoding, settings 0,3,5 on cpu: about 10 minutes on 2 cores")
"""

from __future__ import annotations

import sys
from time import perf_counter
from typing import Callable


def progress(started: float | None = None) -> Callable[[str], None]:
    """A function printing its line on stderr, stamped with the seconds since `started` (default: now)."""
    start = perf_counter() if started is None else started

    def log(line: str) -> None:
        print(f"[{perf_counter() - start:5.0f}s] {line}", file=sys.stderr, flush=True)

    return log


def needs_cuda(name: str) -> int | None:
    """2 after one line on stderr when this machine has no CUDA device (the benchmark `name` cannot run), else None.

    Meant for `if (code := needs_cuda("benchmarks.x")) is not None: return code` at the top of a main."""
    import torch

    if torch.cuda.is_available():
        return None
    print(f"{name} needs a CUDA device (torch.cuda.is_available() is False on this machine)", file=sys.stderr, flush=True)
    return 2
