"""Regular expressions that come from adapter configs, matched so that no config can stall the server.

PEFT reads several `adapter_config.json` fields as regexes (`target_modules` and `exclude_modules`
given as a string, the keys of `rank_pattern` / `alpha_pattern`, `layers_pattern`). A tenant writes
those, so a pattern such as `mode(.|.)*Z` must not cost seconds of backtracking per module name while
holding the interpreter lock. Each pattern is compiled with RE2 (linear time in the name's length)
when RE2 can express it; one that needs backtracking features (lookaround, backreferences) falls back
to the `regex` module, which releases the interpreter lock while it matches and stops at a deadline.
All the fallback matches of one adapter share one time budget; running out of it refuses the adapter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import re2
import regex

from loraplex.lora.errors import AdapterInvalid

# Longest pattern we compile: module-name patterns are a few dozen characters; megabytes are an attack.
MAX_PATTERN_CHARS = 4096
# Wall time that all backtracking (non-RE2) matches of one adapter config may take together.
FALLBACK_BUDGET_S = 0.25

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a pattern RE2 cannot run is expected: we fall back, no stderr noise


@dataclass
class MatchBudget:
    """Seconds left for backtracking matches (shared by all patterns of one adapter config)."""

    seconds: float = FALLBACK_BUDGET_S

    def spend(self, elapsed: float) -> None:
        self.seconds -= elapsed


@dataclass(eq=False)
class UserPattern:
    """One tenant-written regex; `field` names where it came from, for error messages."""

    source: str
    field: str
    budget: MatchBudget = field(default_factory=MatchBudget)

    def __post_init__(self) -> None:
        if len(self.source) > MAX_PATTERN_CHARS:
            raise AdapterInvalid(f"{self.field}: the regex is {len(self.source)} characters long; at most {MAX_PATTERN_CHARS}")
        try:
            self._re2 = re2.compile(self.source, _RE2_OPTIONS)
            self._fallback = None
        except re2.error:
            self._re2 = None
            try:
                self._fallback = regex.compile(self.source)
            except (regex.error, OverflowError, RecursionError, ValueError) as exc:
                raise AdapterInvalid(f"{self.field}: {self.source!r} is not a valid regex ({exc})") from None

    def fullmatch(self, text: str) -> bool:
        return self._run("fullmatch", text) is not None

    def match(self, text: str):
        """A match anchored at the start of `text` (its groups readable by name), or None."""
        return self._run("match", text)

    def _run(self, how: str, text: str):
        if self._re2 is not None:
            return getattr(self._re2, how)(text)
        if self.budget.seconds <= 0:
            raise self._too_slow()
        started = time.perf_counter()
        try:
            return getattr(self._fallback, how)(text, timeout=self.budget.seconds, concurrent=True)
        except TimeoutError:
            raise self._too_slow() from None
        finally:
            self.budget.spend(time.perf_counter() - started)

    def _too_slow(self) -> AdapterInvalid:
        return AdapterInvalid(
            f"{self.field}: the regex {self.source!r} took more than {FALLBACK_BUDGET_S} s to match module names "
            "(RE2 cannot run it, so it backtracks); simplify it"
        )
