"""What the speculative decoding tests share: a log of what each step verified and kept, runs to compare, and a
chi-square test."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """One scheduled request in one step: its drafts verified and the tokens it kept."""

    request_id: str
    adapter_id: str | None
    num_drafts: int
    kept: list[int]
    prefilling: bool  # the step computed prompt tokens for it


class StepLog:
    """Wraps an engine's runner so each step's scheduled requests are recorded (as `Verified`)."""

    def __init__(self, engine) -> None:
        self.steps: list[list[Verified]] = []
        self._execute = engine.runner.execute
        engine.runner.execute = self._logged

    def _logged(self, scheduled, *args):
        results = self._execute(scheduled, *args)
        self.steps.append([
            Verified(item.request.request_id, item.request.adapter_key, item.num_drafts,
                     [t.token_id for t in result.tokens], item.num_new_tokens > 1 and not item.num_drafts)
            for item, result in zip(scheduled, results)
        ])
        return results

    def last_of(self, request_id: str) -> Verified:
        return [v for step in self.steps for v in step if v.request_id == request_id][-1]

    @property
    def mixed_steps(self) -> int:
        """Steps where a request verified drafts beside one that did not (prefilling or plain decoding)."""
        return sum(1 for step in self.steps if any(v.num_drafts for v in step) and not all(v.num_drafts for v in step))


def run_to_end(engine, jobs, late: int = 0, after_steps: int = 3) -> list:
    """Final outputs of `jobs` ((prompt, params, adapter) each) in order; the last `late` jobs arrive after
    `after_steps` steps, so their prompts are prefilled beside the others' verification rows."""
    early = jobs[: len(jobs) - late]
    requests = [engine.add_request(p, sp, adapter=a) for p, sp, a in early]
    finals = {}

    def step() -> None:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finals[out.request_id] = out

    for _ in range(after_steps if late else 0):
        step()
    requests += [engine.add_request(p, sp, adapter=a) for p, sp, a in jobs[len(early) :]]
    while engine.has_unfinished:
        step()
    return [finals[r.request_id] for r in requests]


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """P(X >= statistic) for X ~ chi-square with len - 1 degrees of freedom (cells merged by the caller)."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    half_dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_dof, torch.tensor(statistic / 2, dtype=torch.float64)))
