"""Structured output: grammars compiled by llguidance (a maintained grammar engine; we write none) against the
model's tokenizer, one matcher per request.

`Grammars.compile(spec)` checks and compiles a request's `GrammarSpec` once per distinct spec (cached, within
`GrammarLimits`) and raises `GrammarError` naming the problem; `Grammars.matcher(spec)` deep-copies the
compiled matcher for one request. Each step the logits pipeline masks every constrained row's logits to the
tokens its matcher allows, before sampling, greedy and sampled rows alike (engine/sampling/grammar_masks.py); the engine
feeds each sampled token to the matcher (`advance`), and the request ends when the matcher says the grammar is
complete and its end-of-sequence token came.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from loraplex.params import GrammarSpec

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
CACHED_GRAMMARS = 256  # distinct specs kept compiled (least recently used go first)
# JSON laid out as json.dumps writes it: ", " and ": " and no other whitespace. With llguidance's default
# (whitespace anywhere) a model can spend its whole budget on newlines and indents. A schema may still ask
# for another layout through its own "x-guidance" options, which override these defaults.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be used; the message says why."""


class GrammarTooCostly(GrammarError):
    """A grammar over one of the limits (text size, compile time); the message names the limit."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost. The work inside a compile and inside each step's mask is bounded by
    llguidance's own fuel limits (LLParserLimits: lexer fuel, Earley items per step, grammar size), which
    fail a runaway grammar with an error naming them; these bound what those do not."""

    max_bytes: int = 64 * 1024  # the spec's text (a schema's JSON, a regex, a choice list)
    compile_timeout_s: float = 10.0


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec`."""
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_LAYOUT)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice: a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise GrammarError(f"unknown grammar kind {spec.kind!r}; known: {', '.join(GRAMMAR_KINDS)}")


class Grammars:
    """One engine's grammar compiler: its tokenizer as llguidance sees it, and compiled matchers per spec.

    Thread-safe: the server compiles a request's grammar on a worker thread before queueing it (`compile`),
    the engine thread copies it (`matcher`). A spec is compiled once: a second caller for a spec being
    compiled waits for that compile, and refusals are remembered like results.
    """

    def __init__(
        self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], limits: GrammarLimits = GrammarLimits()
    ) -> None:
        import llguidance.hf

        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.limits = limits
        self._compiled: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()  # guards _compiled only; compiles run outside it

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for `spec` (GrammarError when it cannot be used)."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: GrammarSpec):
        """The compiled matcher for `spec`, shared: copy it before feeding it tokens (GrammarError when the
        spec cannot be used)."""
        size = len(spec.value.encode())
        if size > self.limits.max_bytes:
            raise GrammarTooCostly(
                f"{spec.kind} is {size} bytes; must be <= {self.limits.max_bytes} (max grammar bytes)"
            )
        with self._lock:
            entry = self._compiled.get(spec)
            owner = entry is None
            if owner:
                entry = self._compiled[spec] = Future()
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(spec)
        if owner:
            try:
                entry.set_result(self._build(spec))
            except GrammarError as exc:
                entry.set_exception(exc)
            except BaseException as exc:  # not the grammar's fault: forget it, so a later request retries
                with self._lock:
                    if self._compiled.get(spec) is entry:
                        del self._compiled[spec]
                entry.set_exception(exc)
                raise
        try:
            return entry.result()
        except GrammarError as exc:  # a fresh exception per caller: one object is never raised in two threads
            raise type(exc)(str(exc)) from None

    def _build(self, spec: GrammarSpec):
        from llguidance import LLMatcher

        started = time.monotonic()
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:  # bad JSON in a schema or choice list
            raise GrammarError(f"{spec.kind}: {exc}") from exc
        compiled = LLMatcher(self.tokenizer, text)
        if compiled.is_error():
            raise GrammarError(f"{spec.kind}: {compiled.get_error()}")
        probe = compiled.deep_copy()  # some problems (an unsatisfiable schema) show at the first mask
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"{spec.kind}: {probe.get_error()}")
        elapsed, limit = time.monotonic() - started, self.limits.compile_timeout_s
        if elapsed > limit:
            raise GrammarTooCostly(
                f"{spec.kind} took {elapsed:.1f} s to compile; must be <= {limit:g} s (grammar compile timeout)"
            )
        return compiled


def advance(matcher, token_id: int) -> str | None:
    """Feed a sampled token to the matcher; the error when the grammar cannot take it (None: it could)."""
    if not matcher.consume_token(token_id):
        return f"the output left its grammar: {matcher.get_error() or 'token not allowed'}"
    return None
