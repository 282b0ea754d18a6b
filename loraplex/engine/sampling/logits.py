"""The logits pipeline: from a step's logits rows to each request's tokens, always in this order.

    non-finite guard -> forced tokens -> grammar masks -> penalties and filters -> draw -> draft verification

The guard looks at the logits as the model made them (forced tokens and masks write -inf, which it must not
take for a diverging row); the penalties, filters and the seeded draw are the per-row processors of
engine/sampling/sampler.py; verification.py keeps a request's accepted drafts. When one request's processing raises, the
step's sequences are processed again one by one and only the one that raised fails.

A row that `plain_argmax` holds for takes the argmax of its raw logits: a CUDA graph computes that with its
logits (`greedy_picks`), and a step of such rows can be launched before the host knows its input tokens
(engine/worker/overlap.py). A new sampling parameter touches this module (`plain_argmax`) and engine/sampling/sampler.py only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from loraplex.engine.sampling.constraints import constrains
from loraplex.engine.sampling.grammar_masks import PendingMasks, apply_grammar_masks
from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.engine.sampling.verification import SampledToken, sample_verified
from loraplex.params import PromptScore, SamplingParams
from loraplex.engine.sampling.sampler import Sampler

NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class StepResult:
    """What one scheduled request got from the step."""

    # The tokens it got, in order: none while its prompt is still being prefilled in chunks, else one; with
    # drafts, the accepted ones and then the token the row after them drew (verification.py).
    tokens: list[SampledToken] = field(default_factory=list)
    # Log-probabilities of the prompt tokens this step covered (first prompt token: None).
    prompt_logprobs: list[PromptScore | None] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's vector, from the step that completes its prompt
    error: str | None = None  # set when this request's computation failed; the request fails alone
    # Set when it could not run this step because a request whose KV blocks it reads failed (containment.py):
    # it goes back to the queue and recomputes them.
    requeue: bool = False


@dataclass(frozen=True)
class ForcedTokens:
    """Tokens an encoder-decoder checkpoint's generation config forces (transformers' ForcedBOS/EOS
    logits processors): `bos` as the first generated token, one of `eos` (a config may list several; the
    lowest id wins the tie, as transformers' argmax) as the last one max_new_tokens allows."""

    bos: int | None = None
    eos: tuple[int, ...] = ()

    def for_request(self, request, drafts_before: int = 0) -> tuple[int, ...]:
        """The tokens this request's next step (or, for a verification row, the step `drafts_before` drafts
        later) is restricted to (empty: no restriction)."""
        generated = len(request.output_ids) + drafts_before
        if self.bos is not None and generated == 0:
            return (self.bos,)
        if self.eos and generated == request.params.max_new_tokens - 1:
            return self.eos
        return ()


def plain_argmax(requests: list, forced: ForcedTokens) -> bool:
    """Whether every request's next token is the argmax of its raw logits (nothing forced, masked,
    penalised or warped, no alternatives reported): what `greedy_picks` computes."""
    return (forced.bos is None and not forced.eos
            and all(r.grammar is None and _takes_plain_argmax(r.params) for r in requests))


def _takes_plain_argmax(params: SamplingParams) -> bool:
    return (params.greedy and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and params.top_n_tokens == 0 and not constrains(params))


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """[3, rows] float64: each row's argmax token, its logprob, and 1.0 where every logit of the row is finite. For
    rows that `plain_argmax` holds for, the token and logprob are what `Sampler` returns, by the same ops (a CUDA
    graph computes them with its logits, and the host reads one small tensor)."""
    x = logits.float()
    tokens = x.argmax(dim=1)
    chosen = torch.log_softmax(x, dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    finite = torch.isfinite(x).all(dim=1)
    return torch.stack((tokens.double(), chosen.double(), finite.double()))


def picked_results(picks: list[list[float]]) -> list[StepResult]:
    """One result per row of `greedy_picks` read on the host: its token, or the non-finite error."""
    tokens, logprobs, finite = picks
    return [StepResult([SampledToken(int(t), lp)]) if ok else StepResult(error=NON_FINITE)
            for t, lp, ok in zip(tokens, logprobs, finite)]


class LogitsPipeline:
    """The logits pipeline of one runner: its forced tokens and its sampler."""

    def __init__(self, forced_tokens: ForcedTokens | None = None) -> None:
        self.forced_tokens = forced_tokens or ForcedTokens()
        self.sampler = Sampler()

    def sample_picked(
        self, scheduled: list[ScheduledRequest], logits: torch.Tensor, picks: torch.Tensor,
        masks: PendingMasks | None,
    ) -> list[StepResult]:
        """One decode row per request, with the greedy picks its logits came with (a CUDA graph's): they are
        the answer when every row takes its plain argmax and is finite, else the rows go through `sample`."""
        if masks is None and plain_argmax([item.request for item in scheduled], self.forced_tokens):
            host = picks.tolist()  # one read
            if all(host[2]):
                return picked_results(host)
        results = [StepResult() for _ in scheduled]
        self.sample(scheduled, list(range(len(scheduled))), [1] * len(scheduled), logits, results, masks,
                    picks[2] != 0)
        return results

    def sample(
        self, scheduled: list[ScheduledRequest], seqs: list[int], counts: list[int], logits: torch.Tensor,
        results: list[StepResult], masks: PendingMasks | None, finite: torch.Tensor | None = None,
    ) -> None:
        """Sample `seqs` from their logits rows (`counts[i]` rows for sequence seqs[i], in order) into `results`;
        `masks`: started for `seqs`; `finite`: whether each row's logits are all finite, where already computed."""
        started = seqs
        logits, seqs = _drop_non_finite(logits, seqs, counts, results, finite)
        try:
            self._process_and_sample(scheduled, started, seqs, logits, results, masks)
        except Exception:  # noqa: BLE001 — one request's logits processing or sampling: it fails alone
            if len(seqs) < 2:
                raise
            self._sample_one_by_one(scheduled, seqs, logits, results)

    def _sample_one_by_one(
        self, scheduled: list[ScheduledRequest], seqs: list[int], logits: torch.Tensor, results: list[StepResult]
    ) -> None:
        """Sample each sequence on its own rows (its grammar mask computed here), failing those that raise. The
        rows may be partly processed already: forced tokens and masks are idempotent, the sampler draws from a
        row's own logits and key (engine/sampling/sampler.py), so each sequence gets the token of a batch without the fault."""
        first = 0
        for i in seqs:
            rows = logits[first : first + scheduled[i].num_drafts + 1]
            first += rows.shape[0]
            try:
                self._process_and_sample(scheduled, [i], [i], rows, results, None)
            except Exception as error:  # noqa: BLE001
                results[i].tokens, results[i].error = [], f"sampling failed for this request: {error}"

    def _process_and_sample(
        self, scheduled: list[ScheduledRequest], started: list[int], seqs: list[int], logits: torch.Tensor,
        results: list[StepResult], masks: PendingMasks | None,
    ) -> None:
        """Forced tokens, grammar masks (`masks`: started for the sequences `started`), then sampling."""
        requests = [scheduled[i].request for i in seqs]
        drafts = [r.draft_ids[: scheduled[i].num_drafts] for r, i in zip(requests, seqs)]
        self._force_tokens(logits, requests, drafts)
        if masks is not None:  # each sequence's first row: the masks started before the forward pass
            first_rows = dict(zip(seqs, itertools.accumulate((len(d) + 1 for d in drafts), initial=0)))
            masks.apply(logits, [first_rows.get(i) for i in started])
        apply_grammar_masks(logits, [r.grammar for r in requests], drafts, first_rows_masked=masks is not None)
        kept = sample_verified(
            self.sampler, logits, [r.params for r in requests], [r.prompt_ids for r in requests],
            [r.output_ids for r in requests], [r.seed for r in requests], drafts,
        )
        for i, tokens in zip(seqs, kept):
            results[i].tokens = tokens

    def _force_tokens(self, logits: torch.Tensor, requests: list, drafts: list[list[int]]) -> None:
        """Rows whose next token the checkpoint forces: every other token's logit becomes -inf. Request i has
        len(drafts[i]) + 1 rows, row j as many generated tokens ahead."""
        rows = ((request, j) for request, d in zip(requests, drafts) for j in range(len(d) + 1))
        for row, (request, j) in enumerate(rows):
            tokens = self.forced_tokens.for_request(request, j)
            if tokens:
                logits[row] = float("-inf")
                logits[row, list(tokens)] = 0.0


def _drop_non_finite(
    logits: torch.Tensor, seqs: list[int], counts: list[int], results: list[StepResult],
    finite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Fail the sequences (`counts[i]` rows each) with a row of NaN or inf logits (a diverging adapter; a
    draft's row too: its keys and values would poison the cache); sample the rest. `finite` [rows]: whether
    each row is all finite, checked already (a CUDA graph does it)."""
    # A row's sum is finite when every logit is (NaN and inf propagate): one cheap reduction per step,
    # the full check only when it fails.
    if finite is None:
        finite = torch.isfinite(logits.sum(dim=1, dtype=torch.float32))
    if finite.all():
        return logits, seqs
    finite = torch.isfinite(logits).all(dim=1).tolist()
    if all(finite):
        return logits, seqs
    owner = [i for i, c in zip(seqs, counts) for _ in range(c)]
    failed = {i for ok, i in zip(finite, owner) if not ok}
    for i in failed:
        results[i].error = NON_FINITE
    keep = [row for row, i in enumerate(owner) if i not in failed]
    return logits[keep], [i for i in seqs if i not in failed]
