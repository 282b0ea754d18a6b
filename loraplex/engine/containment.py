"""Fault containment for one step: a failure fails only the requests it belongs to.

When the whole step raises, its requests are run again in halves (in step order), and each half that still
raises in halves again, until the failing requests are alone: they fail with their error, every other
request keeps the tokens the step gives it.

Requests that share KV blocks: a request admitted with a prefix-cache hit may read blocks that another
request of the same step writes (registered as the step was planned). Such a reader always comes after its
writer in the step (the scheduler registers blocks in step order), so halving keeps a writer in the same or
an earlier run than its readers. A reader whose writer failed cannot run this step (its blocks were never
written): it is requeued, not failed, and recomputes them later (see `StepResult.requeue`).

Running a request again is safe because a step changes no request state (asserted below):
- KV: an attempt writes the keys and values of positions >= num_computed_tokens only; the next attempt zeroes
  the blocks it writes that are fresh this step and writes them again.
- Sampling: a row's draw is keyed by (request seed, len(output_ids)) (engine/sampling/sampler.py), not by its batch or by
  how often it ran, so a seeded request draws the same token on any attempt.
- Grammar matchers advance only in `Engine._append_token`, after the step; the runner reads them (masks) or
  advances copies (drafts).
- The runner's per-request image features are dropped once a prompt is fully computed; an attempt that
  dropped them leaves them to be computed again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from loraplex.engine.worker.runner import StepResult
from loraplex.engine.scheduling.scheduler import ScheduledRequest

log = logging.getLogger(__name__)

# runner.execute: (scheduled, fresh_blocks, fresh_state_blocks) -> one StepResult per scheduled request
Execute = Callable[[list[ScheduledRequest], Sequence[int], Sequence[int]], list[StepResult]]


def written_blocks(item: ScheduledRequest, block_size: int) -> list[int]:
    """The KV blocks a scheduled request writes this step."""
    request = item.request
    first = request.num_computed_tokens // block_size
    last = (request.num_computed_tokens + item.num_new_tokens - 1) // block_size
    return request.block_ids[first : last + 1]


def block_writers(scheduled: Sequence[ScheduledRequest], block_size: int) -> dict[int, int]:
    """Each block written this step -> the index of the request that writes it."""
    return {block: i for i, item in enumerate(scheduled) for block in written_blocks(item, block_size)}


def writers_of(scheduled: Sequence[ScheduledRequest], block_size: int) -> list[set[int]]:
    """Per request, the other requests of the step whose blocks it reads (the ones they write this step)."""
    writer = block_writers(scheduled, block_size)
    writers = [{writer[b] for b in item.request.block_ids if writer.get(b, i) != i} for i, item in enumerate(scheduled)]
    assert all(w < i for i, ws in enumerate(writers) for w in ws), "a reader is scheduled before its writer"
    return writers


def failure_message(item: ScheduledRequest, error: BaseException) -> str:
    key = item.request.adapter_key
    where = "the base model" if key is None else f"adapter {key!r}"
    return f"the step failed for this request ({where}): {error}"


def execute_contained(
    execute: Execute, scheduled: list[ScheduledRequest], error: Exception, block_size: int,
    fresh_blocks: Sequence[int] = (), fresh_state_blocks: Sequence[int] = (),
) -> list[StepResult]:
    """The step's results after `execute(scheduled, ...)` raised `error`: the failing requests get
    `StepResult.error`, readers of their blocks `StepResult.requeue`, the others their results from runs
    without them."""
    state = [(item.request.num_computed_tokens, len(item.request.output_ids)) for item in scheduled]
    writer, writers = block_writers(scheduled, block_size), writers_of(scheduled, block_size)
    fresh_states = set(fresh_state_blocks)
    results: list[StepResult | None] = [None] * len(scheduled)

    def lost_a_writer(i: int) -> bool:
        return any(results[w] is not None and (results[w].error or results[w].requeue) for w in writers[i])

    def attempt(indices: list[int], error: Exception) -> None:
        """`indices` (in step order) raised `error` when run together."""
        if len(indices) == 1:
            (i,) = indices
            log.error("step failed for request %s: %r", scheduled[i].request.request_id, error)
            results[i] = StepResult(error=failure_message(scheduled[i], error))
            return
        half = len(indices) // 2
        for part in (indices[:half], indices[half:]):
            for i in part:
                if lost_a_writer(i):
                    results[i] = StepResult(requeue=True)
            part = [i for i in part if results[i] is None]
            if not part:
                continue
            # The blocks the part writes that are fresh this step are zeroed again: it runs on what it would
            # have found (never those it only reads: an earlier run wrote them).
            items = [scheduled[i] for i in part]
            fresh = [b for b in fresh_blocks if writer.get(b) in part]
            fresh_state = [b for item in items for b in item.request.cross_block_ids if b in fresh_states]
            try:
                got = execute(items, fresh, fresh_state)
            except Exception as part_error:  # noqa: BLE001 — narrowed down further
                attempt(part, part_error)
                continue
            for i, result in zip(part, got):
                results[i] = result
        assert state == [(item.request.num_computed_tokens, len(item.request.output_ids)) for item in scheduled], (
            "a step changed request state: running it again would not give the same tokens"
        )

    attempt(list(range(len(scheduled))), error)
    assert all(result is not None for result in results)
    return results


def failed_install_results(scheduled: Sequence[ScheduledRequest], broken: dict[str, str], block_size: int
                           ) -> list[StepResult]:
    """The step's results when the adapters in `broken` (key -> message) could not be installed: their requests
    fail with the message, readers of the blocks those requests were to write are requeued; the rest (an empty
    result) run."""
    writers = writers_of(scheduled, block_size)
    results = [StepResult() for _ in scheduled]
    for i, item in enumerate(scheduled):
        if item.request.adapter_key in broken:
            results[i].error = broken[item.request.adapter_key]
        elif any(results[w].error or results[w].requeue for w in writers[i]):
            results[i].requeue = True
    return results
