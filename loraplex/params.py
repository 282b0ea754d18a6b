"""Per-request generation parameters, as the engine sees them (validated at the protocol edge).

Pure Python: the scheduler and request state import this without torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (structured output): `kind` is "json_schema" (`value`: the schema as
    JSON text), "json_object" (any JSON object; `value` unused), "regex" (`value`: the pattern) or "choice"
    (`value`: a JSON list of the allowed strings)."""

    kind: str
    value: str


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    typical_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # HF semantics, over prompt + generated tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    seed: int | None = None  # None: the engine picks one and reports it
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_n_tokens: int = 0  # alternatives reported per generated token
    # The next token's restrictions (engine/sampling/constraints.py): (token id, bias) added to its logit; only these
    # ids (empty: any); token sequences never completed; at least `min_tokens` generated before any of
    # `min_tokens_stops` (the engine fills in the model's EOS ids and the stop token ids) or a stop string ends it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    min_tokens_stops: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    prompt_top_n: int = 0  # with prompt_logprobs: the likeliest tokens reported per prompt position (vLLM's k)
    # An embedding request (engine/worker/pooling.py): its prompt's hidden rows pooled into one vector, nothing sampled.
    pooling: "Pooling | None" = None
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the answer stays in its text
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output: tokens outside it are never sampled
    # Prefix caching: only requests with the same salt share cached KV blocks (vLLM's cache_salt: a tenant's own
    # cache space, so no other tenant can learn from timing which prompts it sent). None: the shared space.
    cache_salt: str | None = None

    @property
    def greedy(self) -> bool:
        """TGI's rule: any warper turns sampling on even when do_sample is false."""
        warpers = (
            self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0 or self.min_p > 0.0
        )
        return not (self.do_sample or warpers)

    def __post_init__(self) -> None:
        # Invariants only: user-facing validation with good messages lives in protocol/.
        assert self.max_new_tokens >= 1, "max_new_tokens must be >= 1"
        assert self.temperature > 0.0, "temperature must be > 0"
        assert self.top_k >= 0 and 0.0 < self.top_p <= 1.0 and 0.0 < self.typical_p <= 1.0
        assert 0.0 <= self.min_p < 1.0 and self.repetition_penalty > 0.0


class FinishReason(str, enum.Enum):
    """Why a request's generation ended."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ABORTED = "aborted"


@dataclass
class TokenInfo:
    """One generated (or prompt) token as reported to clients."""

    id: int
    text: str
    logprob: float | None
    special: bool = False
    top_tokens: list["TokenInfo"] = field(default_factory=list)
    rank: int | None = None  # a prompt token's: 1 + the tokens at least as likely as it but itself (vLLM's)


@dataclass(frozen=True)
class Pooling:
    """How an embedding request's vector is made from the final (normed) hidden rows of its prompt: the last row,
    the mean of all rows, the first row or each feature's largest value, then L2-normalised or not."""

    method: str = "last"
    normalize: bool = True

    METHODS = ("last", "mean", "first", "max")

    def __post_init__(self) -> None:
        assert self.method in self.METHODS, f"unknown pooling {self.method!r}"


@dataclass(frozen=True)
class PromptScore:
    """A prompt token's score given the tokens before it: its logprob, its rank, and the likeliest (id, logprob)
    pairs (`SamplingParams.prompt_top_n` of them)."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
