"""Verifying a request's drafts so that its tokens stay exactly those of decoding without them.

A request with k drafts d_0..d_{k-1} computes k + 1 rows in one step: its last token, then the drafts. Row j
predicts the token after d_{j-1}; it is sampled as decoding without drafts would sample that step, had the
drafts before it been generated: with `output_ids + drafts[:j]` (penalties, forced tokens, the grammar's
mask) and the draw key of step `len(output_ids) + j` (see engine/sampling/sampler.py: a row's draw is a pure function of
its processed logits and that key). Draft j is accepted iff row j drew it; the first row that drew something
else gives the step's last token (the "bonus" token), and the drafts after it are discarded. When every
draft is accepted, row k's draw is the bonus token.

So each token kept is the token decoding without drafts would have drawn at that step, with the same seed:
the outputs are identical, greedy or sampled. For one draft, accepting it when the row's draw equals it is
rejection sampling with a one-hot draft distribution: accepted with probability p(d), otherwise the row's
draw, which then follows p with d removed and renormalised; the distribution of the kept token is p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplex.params import SamplingParams
from loraplex.engine.sampling.sampler import Sampler


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_tokens: list[tuple[int, float]] = field(default_factory=list)


def accepted_prefix(drafts: Sequence[int], drawn: Sequence[int]) -> int:
    """How many drafts are accepted: the length of the prefix where each row drew its draft."""
    accepted = 0
    while accepted < len(drafts) and drawn[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


def sample_verified(
    sampler: Sampler,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    seeds: Sequence[int],
    drafts: Sequence[Sequence[int]],
) -> list[list[SampledToken]]:
    """Per request, the tokens it keeps: its accepted drafts, then the bonus token, each reported (logprob,
    top tokens) from its own row. `logits` holds len(drafts[i]) + 1 rows for request i, in request order,
    already masked (forced tokens, grammar) row by row."""
    owner = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    ahead = [j for d in drafts for j in range(len(d) + 1)]  # drafts before the row
    out = sampler(
        logits,
        [params[i] for i in owner],
        [prompt_ids[i] for i in owner],
        [output_ids[i] if j == 0 else [*output_ids[i], *drafts[i][:j]] for i, j in zip(owner, ahead)],
        [seeds[i] for i in owner],
    )
    kept: list[list[SampledToken]] = []
    first = 0
    for d in drafts:
        keep = accepted_prefix(d, out.token_ids[first : first + len(d)]) + 1
        rows = range(first, first + keep)
        kept.append([SampledToken(out.token_ids[r], out.logprobs[r], out.top_tokens[r]) for r in rows])
        first += len(d) + 1
    return kept
