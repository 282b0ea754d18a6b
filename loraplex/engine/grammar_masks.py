"""Structured output's token masks, computed while the model runs.

A constrained row's mask depends only on its matcher's state, which no step changes before its token is
sampled. So the runner starts the masks of the step's constrained rows before the forward pass and
collects them just before sampling: llguidance fills them on its own threads (the GIL released), and torch
releases the GIL inside its kernels, so the two overlap. Masks go on the logits before sampling, greedy and
sampled rows alike (a masked logit is -inf: never the argmax, never drawn).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loraplex.structured import mask_rows


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
