"""Structured output: grammars compiled by llguidance (a maintained grammar engine; we write none) against the
model's tokenizer, one matcher per request.

`Grammars.matcher(spec)` checks and compiles a request's `GrammarSpec` once per distinct spec (cached, then
deep-copied per request) and raises `GrammarError` naming the problem. Each step the runner masks every
constrained row's logits to the tokens its matcher allows (`apply_masks`, before sampling, greedy and sampled
rows alike); the engine feeds each sampled token to the matcher (`advance`), and the request ends when the
matcher says the grammar is complete and its end-of-sequence token came.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from loraplex.params import GrammarSpec

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
CACHED_GRAMMARS = 256  # distinct specs kept compiled (least recently used go first)


class GrammarError(ValueError):
    """A grammar that cannot be used; the message says why."""


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec`."""
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.value)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice: a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise GrammarError(f"unknown grammar kind {spec.kind!r}; known: {', '.join(GRAMMAR_KINDS)}")


class Grammars:
    """One engine's grammar compiler: its tokenizer as llguidance sees it, and compiled matchers per spec."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance.hf

        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # compiled off the engine thread (the server's edge) and on it

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for `spec` (GrammarError when it cannot be used)."""
        from llguidance import LLMatcher

        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:  # bad JSON in a schema or choice list, a bad regex
            raise GrammarError(f"{spec.kind}: {exc}") from exc
        problem = LLMatcher.validate_grammar(text, self.tokenizer)
        if problem:
            raise GrammarError(f"{spec.kind}: {problem}")
        compiled = LLMatcher(self.tokenizer, text)
        if compiled.is_error():
            raise GrammarError(f"{spec.kind}: {compiled.get_error()}")
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


def apply_masks(logits: torch.Tensor, matchers: list) -> None:
    """Set to -inf, in place, every logit of a row whose matcher (None: unconstrained) does not allow that token."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import llguidance.torch as lt

    bitmask = lt.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, i in enumerate(rows):
        lt.fill_next_token_bitmask(matchers[i], bitmask, j)
    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index)
    lt.apply_token_bitmask_inplace(constrained, bitmask.to(logits.device))
    logits.index_copy_(0, index, constrained)


def advance(matcher, token_id: int) -> str | None:
    """Feed a sampled token to the matcher; the error when the grammar cannot take it (None: it could)."""
    if not matcher.consume_token(token_id):
        return f"the output left its grammar: {matcher.get_error() or 'token not allowed'}"
    return None
