"""Overlapped decode steps: step N+1 is launched before the host has read step N's tokens.

A graphed decode step is short; scheduling the next step, staging its inputs, reading the tokens and updating
the requests (detokenizing, stop checks) is host work the GPU would otherwise wait for. With overlap the engine
launches a step that needs no token from the host (every row decodes its plain argmax: `logits.plain_argmax`,
engine/worker/runner.py `launchable`) and returns at once; at the next `step()` it schedules and launches the following
step, whose rows take their input tokens from the launched step's picks on the device (engine/worker/decode_graphs.py),
and only then reads the first step's tokens.

Until a launched step is read, each of its requests counts its token as computed and holds a placeholder for it
at the end of `output_ids` (`Request.num_pending`), so the scheduler plans the next step as if the token were
known. A token that must end its request by length (max_new_tokens, the longest sequence) gets no placeholder:
the request is then not scheduled again. A request that ends when its token is read (EOS, a stop sequence, a
non-finite row) has computed one more step for nothing; that row's result is dropped, and its KV write went to
blocks it gave back, which the next step zeroes before any new owner reads them (the writes are ordered on the
stream). Any step that cannot be launched so (a prefill, sampling with parameters, grammars, drafts) first reads
the launched step, then runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.engine.requests.request import Request

if TYPE_CHECKING:
    import torch

    from loraplex.engine.sampling.logits import StepResult
    from loraplex.engine.scheduling.scheduler import ScheduledRequest, SchedulerOutput

PENDING = -1  # an output token a launched step is computing


@dataclass
class LaunchedStep:
    """The runner's handle on a step it launched: each request's row, and where its tokens will be read."""

    rows: dict[Request, int]  # the row of each request (its token's place in the step's picks on the device)
    order: list[int]  # row -> the request's position in the scheduled list
    picks: "torch.Tensor | None" = None  # host copy [3, rows] of the greedy picks, valid once `ready`
    ready: "torch.cuda.Event | None" = None
    results: "list[StepResult] | None" = None  # by row, when known at launch (eager steps)


@dataclass
class InFlight:
    """The engine's record of a launched step: its plan, the runner's handle, where each request's token goes (an
    index into its output_ids, or None: appended when read, the token that ends it by length), and each request's
    computed tokens before the step (a request whose row fails goes back to them: its keys and values from there
    on are not kept, in the prefix cache either)."""

    plan: "SchedulerOutput"
    launched: LaunchedStep
    places: list[int | None]
    computed: list[int]


def in_flight(plan: "SchedulerOutput", launched: LaunchedStep, max_total_tokens: int) -> InFlight:
    """The record of a step just launched; each of its requests counts its token as computed and holds a placeholder
    for it, unless the token must end the request by length."""
    computed = [item.request.num_computed_tokens for item in plan.scheduled]
    return InFlight(plan, launched, _hold_places(plan.scheduled, max_total_tokens), computed)


def _hold_places(scheduled: "list[ScheduledRequest]", max_total_tokens: int) -> list[int | None]:
    places: list[int | None] = []
    for item in scheduled:
        request = item.request
        assert item.num_new_tokens == 1 and request.num_uncomputed_tokens == 1, "only decode rows are launched"
        request.num_computed_tokens += 1
        last = (len(request.output_ids) + 1 >= request.params.max_new_tokens
                or request.num_tokens + 1 >= max_total_tokens)
        if last:
            places.append(None)
        else:
            places.append(len(request.output_ids))
            request.output_ids.append(PENDING)
            request.num_pending += 1
    return places


def drop_placeholders(request: Request) -> None:
    """A request leaves the engine: the tokens still being computed for it will never be read."""
    if request.num_pending:
        del request.output_ids[-request.num_pending :]
        request.num_pending = 0
