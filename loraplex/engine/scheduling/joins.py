"""When waiting requests join the running batch: LoRAX's (and TGI's) `--max-waiting-tokens` and
`--waiting-served-ratio`.

Where decode steps replay CUDA graphs (engine/worker/decode_graphs.py), a step that admits a request runs eagerly, and
an eager step of a full batch costs the host many graphed decode steps' time (the prefill's own compute is a small
part of it; docs/benchmarks.md has the figures). Admitting at every step that frees a seat then turns most steps
eager. So, while requests run, waiting ones join only when

- the step runs eagerly anyway (a running request computes a prompt chunk), or
- they are many beside the running ones: at least `served_ratio` times as many, or
- no request has joined for `max_waiting_steps` steps (a lone arrival after a quiet stretch joins at once).

With nothing running they join at once. `max_waiting_steps` 0 (the engine's choice where every step is eager:
there a late join saves nothing) admits at every step. TGI counts admissible requests against the ratio; this
counts the whole queue, since a queue far longer than one step's prefill budget would otherwise never reach it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WaitingJoins:
    max_waiting_steps: int = 0  # 0: waiting requests may join at every step
    served_ratio: float = 1.2
    steps_waited: int = 0  # steps since a request last joined

    def due(self, waiting: int, running: int, eager_anyway: bool) -> bool:
        """Whether this step admits waiting requests (`waiting` of them queued, `running` running)."""
        if self.max_waiting_steps == 0 or not running or eager_anyway:
            return True
        return waiting >= self.served_ratio * running or self.steps_waited >= self.max_waiting_steps

    def stepped(self, joined: bool) -> None:
        """Count a step in which requests joined (`joined`) or none did."""
        self.steps_waited = 0 if joined else self.steps_waited + 1
