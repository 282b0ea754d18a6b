"""Speculative decoding's drafts: n-gram prompt lookup (LoRAX's `--speculative-tokens`). Pure Python.

After each step, a decoding request looks for the most recent earlier place where its own tokens (the
encoder's input for an encoder-decoder model, then the prompt, then the output) end the way they end now:
the longest such suffix of at most `MAX_NGRAM` tokens wins (a longer match predicts better); among equally
long ones, the most recent occurrence that is followed by N tokens (in a run of one repeated token or phrase
the latest occurrences overlap the end and have fewer), else the one followed by the most; the most recent
breaks remaining ties (a request that copies text goes on copying from where it is). The up to N tokens that
followed that occurrence are the drafts. Copy-heavy work (repeating, quoting, editing or
summarising a given text, code with repeated names) accepts many of them; elsewhere a draft costs one more
row in a step that computes the request anyway, and nothing when no suffix matches.

`MIN_NGRAM` is 2: a match of one token (often a common one: " the", ",") predicts poorly. On the copy-heavy
workload of `python -m benchmarks.speculative` (SmolLM2-135M, 3 drafts) one-token matches brought the share of
accepted drafts from 0.68 down to 0.40 for 5% more accepted tokens, and each rejected draft costs a row of
compute: next to nothing on a GPU, whose decode step is bound by reading the weights, but on a CPU the step's
matrix products grow with its rows.

The model verifies the drafts in the next step (see verification.py); the outputs stay exactly those of
decoding without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.engine.requests.request import Request, RequestStatus

MAX_NGRAM = 3
MIN_NGRAM = 2


def propose(
    tokens: Sequence[int], num_drafts: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to `num_drafts` tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` (at most `max_ngram`, at least `min_ngram` long); [] when no suffix occurred before."""
    n = len(tokens)
    if num_drafts <= 0 or n < 2:
        return []
    tokens = tokens if isinstance(tokens, list) else list(tokens)  # list.index searches in C
    last = tokens[-1]
    best, best_end = (0, 0), -1  # (match length, tokens it would draft) of the best occurrence; its last index
    # Occurrences of the last token before the end, found left to right (the most recent wins a tie); the
    # search ends at the last token itself.
    i = tokens.index(last)
    while i < n - 1:
        length = 1
        while length < max_ngram and length <= i and tokens[i - length] == tokens[n - 1 - length]:
            length += 1
        score = (length, min(n - 1 - i, num_drafts))
        if score >= best:
            best, best_end = score, i
        i = tokens.index(last, i + 1)
    if best_end < 0 or best[0] < min_ngram:
        return []
    return tokens[best_end + 1 : best_end + 1 + num_drafts]


def draft_limit(num_tokens: int, num_generated: int, max_new_tokens: int, max_total_tokens: int) -> int:
    """Most drafts a request may verify: the step adds accepted drafts plus one token of its own, and must
    not take the request past max_new_tokens or the longest sequence allowed."""
    return max(0, min(max_new_tokens - num_generated, max_total_tokens - num_tokens) - 1)


def drafts_for(request, most: int, max_total_tokens: int) -> list[int]:
    """The drafts of a decoding request (an engine.request.Request) for its next step: at most `most`, within its
    limits, from its own tokens (an encoder-decoder's output often copies its encoder's input: that is searched
    too), cut to what its grammar takes."""
    limit = draft_limit(request.num_tokens, len(request.output_ids), request.params.max_new_tokens, max_total_tokens)
    drafts = propose((request.encoder_ids or []) + request.prompt_ids + request.output_ids, min(most, limit))
    if drafts and request.grammar is not None:
        drafts = drafts_within_grammar(request.grammar, drafts)
    return drafts


def propose_drafts(requests: Sequence[Request], most: int, max_total_tokens: int) -> None:
    """Drafts for the next step of each of the step's requests still decoding."""
    for request in requests:
        if request.status is RequestStatus.RUNNING and request.num_uncomputed_tokens == 1:
            request.draft_ids = drafts_for(request, most, max_total_tokens)


def drafts_within_grammar(matcher, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` that the grammar takes without completing: a draft that completes it
    would end the request, so it comes as the bonus token instead (and no row is masked from a finished state)."""
    ahead = matcher.deep_copy()
    taken = 0
    for token in drafts[: matcher.validate_tokens(drafts)]:  # validate first: a refused token logs an error
        ahead.consume_token(token)
        if ahead.is_stopped():
            break
        taken += 1
    return drafts[:taken]


@dataclass
class SpecDecodeCounters:
    """Engine-wide totals (read by /metrics): drafts the model verified, and those it accepted."""

    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
