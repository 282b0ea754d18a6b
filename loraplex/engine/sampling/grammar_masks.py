"""Structured output's token masks on the logits (a step of the logits pipeline, engine/sampling/logits.py).

A constrained row's mask depends only on its matcher's state, which no step changes before its token is
sampled. So the runner starts the masks of the step's constrained rows before the forward pass and the
pipeline collects them just before sampling (`GrammarMasks`): llguidance fills them on its own threads (the
GIL released), and torch releases the GIL inside its kernels, so the two overlap. Draft rows are masked in
the pipeline itself (`apply_grammar_masks`), each from the grammar state after the drafts before it. Masks go
on the logits before sampling, greedy and sampled rows alike (a masked logit is -inf: never the argmax, never
drawn).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class GrammarMasks:
    """Starts and applies one step's masks. `vocab_size`: the tokenizer's vocabulary the matchers were built on
    (logits wider than it, padding of the head, are masked out)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-grammar")
        self._executor = None  # llguidance's thread pool, made at the first constrained step

    def start(self, matchers: list) -> "PendingMasks | None":
        """Begin filling the masks of the rows whose matcher is not None (rows in the order sampling will use)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        import llguidance
        import llguidance.torch as lt

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = lt.allocate_token_bitmask(len(rows), self.vocab_size)
        work = [(matchers[i], j) for j, i in enumerate(rows)]
        future = self._pool.submit(lt.fill_next_token_bitmask_par, self._executor, work, bitmask)
        return PendingMasks(rows, bitmask, future)


class PendingMasks:
    def __init__(self, rows: list[int], bitmask: torch.Tensor, future: Future) -> None:
        self.rows, self.bitmask, self.future = rows, bitmask, future

    def apply(self, logits: torch.Tensor, rows: list[int | None]) -> None:
        """Mask `logits` in place: `rows[k]` is the logits row of the k-th matcher given to `start` (None: that
        row was dropped since, e.g. for non-finite logits)."""
        self.future.result()
        pairs = [(j, rows[k]) for j, k in enumerate(self.rows) if rows[k] is not None]
        if pairs:
            mask_rows(logits, [r for _, r in pairs], self.bitmask[[j for j, _ in pairs]])


def apply_grammar_masks(
    logits: torch.Tensor, matchers: Sequence, drafts: Sequence[Sequence[int]], first_rows_masked: bool = False
) -> None:
    """Mask each constrained request's rows (matcher None: unconstrained): row j with the grammar state after
    drafts[:j], from a copy of the matcher advanced draft by draft (the request's own matcher only ever takes
    kept tokens). The drafts must be ones the grammar takes (see `speculative.drafts_within_grammar`). `first_rows_masked`:
    each request's first row is masked already (`PendingMasks`, filled while the model ran)."""
    firsts = [0]
    for d in drafts:
        firsts.append(firsts[-1] + len(d) + 1)
    if not first_rows_masked:
        first_rows = [None] * firsts[-1]
        for i, matcher in enumerate(matchers):
            first_rows[firsts[i]] = matcher
        apply_masks(logits, first_rows)  # every request's first row, in one batch
    for i, matcher in enumerate(matchers):
        if matcher is None or not drafts[i]:
            continue
        ahead = matcher.deep_copy()
        for j, token in enumerate(drafts[i], start=1):
            assert ahead.consume_token(token), "a draft the grammar refuses: drafts_within_grammar cuts those"
            row = firsts[i] + j
            apply_masks(logits[row : row + 1], [ahead])


def apply_masks(logits: torch.Tensor, matchers: list) -> None:
    """Set to -inf, in place, every logit of a row whose matcher (None: unconstrained) does not allow that token."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import llguidance.torch as lt

    bitmask = lt.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, i in enumerate(rows):
        lt.fill_next_token_bitmask(matchers[i], bitmask, j)
    mask_rows(logits, rows, bitmask)


def mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Apply llguidance bitmask row j to logits row rows[j], in place (disallowed tokens become -inf)."""
    import llguidance.torch as lt

    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index)
    lt.apply_token_bitmask_inplace(constrained, bitmask.to(logits.device))
    logits.index_copy_(0, index, constrained)
