"""LoRAX/TGI-native schemas: POST /generate, /generate_stream, / and /tokenize."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, field_validator, model_validator

from loraplex.params import GrammarSpec, SamplingParams, TokenInfo
from loraplex.protocol.base import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SAMPLING_EPS,
    RequestModel,
    finite_logprob,
)
from loraplex.protocol.openai import ChatMessage, StopSequence
from loraplex.protocol.errors import Unsupported
from loraplex.protocol.structured_output import Constraint, one_constraint, response_format_spec, schema_spec

log = logging.getLogger(__name__)

# A temperature above this is noise already (TGI sets no bound; float32 overflows past 3.4e38).
MAX_TEMPERATURE = 100.0
# The most alternatives per generated token, for TGI's top_n_tokens and LoRAX's return_k_alternatives alike (TGI
# bounds top_n_tokens by its launcher's --max-top-n-tokens, default 5; here a protocol constant, LoRAX's 10).
MAX_TOP_N_TOKENS = 10
_MESSAGES = TypeAdapter(list[ChatMessage])


class MergedAdapters(RequestModel):
    """Serve a weighted merge of adapters (as PEFT's add_weighted_adapter builds it)."""

    ids: list[str]
    weights: list[float]
    # lorax-client sends null for the ones its caller left out: null means the default.
    merge_strategy: Literal["linear", "cat", "ties", "dare_linear", "dare_ties", "magnitude_prune"] | None = "linear"
    density: float = Field(default=1.0, gt=0.0, le=1.0)
    majority_sign_method: Literal["total", "frequency"] | None = "total"


class TgiGrammar(RequestModel):
    """TGI's `parameters.grammar`: {"type": "json" (alias "json_object"), "value": a JSON schema, or its JSON text},
    {"type": "regex", "value": a pattern}; and newer TGI's {"type": "json_schema", "value": {"name", "schema"}}."""

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any

    def spec(self, where: str) -> GrammarSpec:
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise Unsupported(f"{where}.value must be a regular expression (a string)", f"{where}.value")
            return GrammarSpec("regex", self.value)
        if self.type == "json_schema":
            if not isinstance(self.value, dict) or self.value.get("schema") is None:
                raise Unsupported(f"{where}.value of type json_schema needs its schema (value.schema)", f"{where}.value")
            return schema_spec(self.value["schema"], f"{where}.value.schema")
        return schema_spec(self.value, f"{where}.value")


def _note_unknown(model: type[BaseModel], data: Any, where: str) -> None:
    """Fields no peer's API defines are ignored, and listed at debug level (a typo shows up there)."""
    if isinstance(data, dict) and log.isEnabledFor(logging.DEBUG):
        unknown = sorted(str(k) for k in data if k not in model.model_fields)
        if unknown:
            log.debug("%s: ignoring unknown fields %s", where, ", ".join(unknown))


class GenerateParameters(RequestModel):
    adapter_id: str | None = None
    adapter_source: str | None = None
    merged_adapters: MergedAdapters | None = None
    # A Hugging Face token for a private hub adapter: checked with the hub on every request, never logged.
    api_token: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    max_new_tokens: int | None = Field(default=None, ge=1)
    do_sample: bool = False
    temperature: float | None = Field(default=None, gt=0.0, le=MAX_TEMPERATURE)  # below SAMPLING_EPS: greedy
    top_k: int | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: list[StopSequence] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    truncate: int | None = Field(default=None, ge=1)
    return_full_text: bool = False
    details: bool = False
    decoder_input_details: bool = False
    # LoRAX's alternatives (each token's `alternative_tokens`) and TGI's (`details.top_tokens`, a stream event's
    # `top_tokens`): the engine reports the larger count, each field shows its own.
    return_k_alternatives: int | None = Field(default=None, ge=0, le=MAX_TOP_N_TOKENS)
    top_n_tokens: int | None = Field(default=None, ge=0, le=MAX_TOP_N_TOKENS)
    ignore_eos_token: bool = False
    apply_chat_template: bool = False
    # TGI's watermarking (Kirchenbauer et al.) is not served: false (TGI clients' default) is accepted, true refused.
    watermark: bool = False
    # TGI's structured output (see TgiGrammar); at most one of grammar and response_format.
    grammar: TgiGrammar | None = None
    # Structured output, LoRAX's form: {"type": "json_object", "schema": {...}} (the schema optional: any JSON
    # object), or {"type": "json_schema", "schema" | "json_schema": {...}}; raises Unsupported.
    response_format: dict | None = None
    # Prefix caching: requests share cached prompt blocks only with the same salt (vLLM's cache_salt).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _unknown(cls, data: Any) -> Any:
        _note_unknown(cls, data, "parameters")
        return data

    @field_validator("watermark")
    @classmethod
    def _no_watermark(cls, value: bool) -> bool:
        if value:
            raise ValueError("watermark is not served (TGI's watermarking): send false or leave it out")
        return value

    def output_constraint(self) -> Constraint | None:
        """(field, grammar) of the answer's constraint (Unsupported naming the field when it is not one we serve,
        or when both response_format and grammar are given)."""
        found = []
        if (spec := response_format_spec(self.response_format, "parameters.response_format")) is not None:
            found.append(("parameters.response_format", spec))
        if self.grammar is not None:
            found.append(("parameters.grammar", self.grammar.spec("parameters.grammar")))
        return one_constraint(found)

    def output_grammar(self) -> GrammarSpec | None:
        constraint = self.output_constraint()
        return constraint[1] if constraint else None

    def to_sampling_params(self, max_new_tokens: int, seed: int | None = None) -> SamplingParams:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            do_sample=self.do_sample,
            temperature=self.temperature or 1.0,
            top_k=self.top_k or 0,
            top_p=self.top_p or 1.0,
            typical_p=self.typical_p or 1.0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=self.seed if seed is None else seed,
            stop=tuple(self.stop),
            ignore_eos=self.ignore_eos_token,
            top_n_tokens=max(self.return_k_alternatives or 0, self.top_n_tokens or 0),
            prompt_logprobs=self.decoder_input_details,
            grammar=self.output_grammar(),
            cache_salt=self.cache_salt,
        )
        if self.temperature is not None and self.temperature < SAMPLING_EPS:  # vLLM's rule: greedy, warpers off
            return replace(params, do_sample=False, temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0, min_p=0.0)
        return params


def _messages_in(inputs: str) -> list[Any] | None:
    """`inputs` as a JSON list of messages (objects with a role), else None: the text is one user turn."""
    try:
        messages = json.loads(inputs)
    except (ValueError, RecursionError):  # not JSON (or nested past what json parses)
        return None
    if isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages):
        return messages
    return None


class GenerateRequest(RequestModel):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)

    @model_validator(mode="before")
    @classmethod
    def _unknown(cls, data: Any) -> Any:
        _note_unknown(cls, data, "body")
        return data

    @model_validator(mode="after")
    def _chat_messages_by_schema(self) -> "GenerateRequest":
        """Messages in `inputs` are checked as the OpenAI chat route checks its own (roles, content, text)."""
        messages = _messages_in(self.inputs) if self.parameters.apply_chat_template else None
        if messages is not None:
            try:
                _MESSAGES.validate_python(messages)
            except ValidationError as exc:
                first = max(exc.errors(), key=lambda e: len(e["loc"]))  # a union's furthest branch
                where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
                raise ValueError(f"inputs (chat messages){where}: {first['msg']}") from None
        return self

    def chat_messages(self) -> list[dict]:
        """`inputs` as chat messages when apply_chat_template is set: a JSON list of messages, or one user turn."""
        messages = _messages_in(self.inputs)
        return [{"role": "user", "content": self.inputs}] if messages is None else messages


class CompatGenerateRequest(GenerateRequest):
    """POST / : the same request with a `stream` switch."""

    stream: bool = False


class TokenizeRequest(RequestModel):
    inputs: str
    add_special_tokens: bool = True


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False
    alternative_tokens: list["Token"] | None = None

    @field_validator("logprob")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return None if value is None else finite_logprob(value)  # None: the first prompt token has none

    @classmethod
    def of(cls, info: TokenInfo, alternatives: int = 0) -> "Token":
        """The token, with its best `alternatives` (LoRAX's return_k_alternatives; 0: none) as alternative_tokens."""
        shown = [cls.of(t) for t in info.top_tokens[:alternatives]] if alternatives and info.top_tokens else None
        return cls(id=info.id, text=info.text, logprob=info.logprob, special=info.special, alternative_tokens=shown)

    @classmethod
    def top(cls, info: TokenInfo, n: int) -> list["Token"]:
        """TGI's top_tokens of a generated token: its best `n` alternatives, best first."""
        return [cls.of(t) for t in info.top_tokens[:n]]


FinishReasonName = Literal["length", "eos_token", "stop_sequence"]


class _SequenceDetails(BaseModel):
    finish_reason: FinishReasonName
    generated_tokens: int
    seed: int | None = None
    prefill: list[Token] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)
    top_tokens: list[list[Token]] | None = None  # TGI's: top_n_tokens per generated token (only when asked)


class BestOfSequence(_SequenceDetails):
    generated_text: str


class Details(_SequenceDetails):
    prompt_tokens: int
    # Why `prefill` is empty although decoder_input_details was asked for (an encoder-decoder model's
    # input is encoded, not predicted: its tokens have no logprobs).
    prefill_note: str | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReasonName
    prompt_tokens: int
    generated_tokens: int
    seed: int | None = None


class StreamResponse(BaseModel):
    token: Token
    top_tokens: list[Token] | None = None  # TGI's: the token's top_n_tokens (only when asked)
    generated_text: str | None = None
    details: StreamDetails | None = None
