"""OpenAI API response schemas: completions, chat completions (whole and streamed chunks), /v1/models, usage and
logprobs, as vLLM serves them. Reported logprobs are finite (JSON cannot carry -inf or NaN)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer

from loraplex.params import FinishReason, TokenInfo
from loraplex.protocol.base import finite_logprob
from loraplex.protocol.tools.parsers import Delta, ToolCall

FinishReasonName = Literal["stop", "length", "tool_calls"]
def logprob(value: float | None) -> float:
    """None (no logprob), -inf (a masked token) and NaN are reported as MIN_LOGPROB: JSON cannot carry them."""
    return finite_logprob(value)


def finish_reason_name(reason: FinishReason | None) -> FinishReasonName:
    """OpenAI has "stop" (end of sequence token or a stop sequence) and "length"."""
    return "length" if reason is FinishReason.LENGTH else "stop"


# ---- responses -----------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplex"
    root: str | None = None
    parent: str | None = None
    input_modalities: list[str] = ["text"]  # ["text", "image"] for a model that takes images


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, tokens: list[TokenInfo], offset: int, token_text: Callable[[int], str]) -> int:
        """Append tokens whose text starts at `offset`; returns the offset after them. A token's share of the
        text is `TokenInfo.text` (a generated token's piece; a prompt token's own text)."""
        for t in tokens:
            text = token_text(t.id)
            self.tokens.append(text)
            self.token_logprobs.append(None if t.logprob is None else logprob(t.logprob))
            top = {text: logprob(t.logprob)} | {a.text: logprob(a.logprob) for a in t.top_tokens}
            self.top_logprobs.append(None if t.logprob is None else top)
            self.text_offset.append(offset)
            offset += len(t.text)
        return offset


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as its `prompt_logprobs` carry it: a token's logprob, its rank (1: the likeliest) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_of(tokens: list[TokenInfo] | None, token_text: Callable[[int], str]) -> PromptLogprobs:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing predicts it), then for each prompt token
    {token id: Logprob} of the token itself and of the likeliest tokens asked for (ranks 1..k; the prompt token's
    entry is the same when it is one of them)."""

    def entry(t: TokenInfo, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=logprob(t.logprob), rank=rank, decoded_token=token_text(t.id))

    return [
        None if t.logprob is None else
        {t.id: entry(t, t.rank)} | {a.id: entry(a, k) for k, a in enumerate(t.top_tokens, 1) if a.id != t.id}
        for t in tokens or []
    ]


def _without_absent_prompt_logprobs(data: dict[str, Any], value: Any) -> dict[str, Any]:
    """`prompt_logprobs` only when asked for (vLLM's field; absent from OpenAI's answers)."""
    if value is None:
        data.pop("prompt_logprobs", None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asked for them

    @model_serializer(mode="wrap")
    def _prompt_logprobs_when_asked(self, handler) -> dict[str, Any]:
        return _without_absent_prompt_logprobs(handler(self), self.prompt_logprobs)


class _Envelope(BaseModel):
    """What every completion response and stream chunk carries."""

    id: str
    created: int
    model: str
    usage: UsageInfo | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None

    @field_validator("logprob")
    @classmethod
    def _finite(cls, value: float) -> float:
        return finite_logprob(value)


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, tokens: list[TokenInfo], token_text: Callable[[int], str]) -> ChoiceLogprobs:
        def top(t: TokenInfo, text: str) -> dict:
            return {"token": text, "logprob": logprob(t.logprob), "bytes": list(text.encode())}

        return cls(content=[
            TokenLogprob(**top(t, token_text(t.id)), top_logprobs=[TopLogprob(**top(a, a.text)) for a in t.top_tokens])
            for t in tokens
        ])


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallOut:
        return cls(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler) -> dict[str, Any]:
        """`tool_calls` only when the answer made calls (as OpenAI answers)."""
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asked for them

    @model_serializer(mode="wrap")
    def _prompt_logprobs_when_asked(self, handler) -> dict[str, Any]:
        return _without_absent_prompt_logprobs(handler(self), self.prompt_logprobs)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A call's first delta carries its index, id, type and name (arguments ""); later ones argument pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        """A delta carries only what changed: `{}` on the final chunk."""
        data: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls is not None:
            data["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        return data

    @classmethod
    def of(cls, delta: Delta) -> DeltaMessage:
        """A parsed piece of an answer (protocol/tools/parsers.py) as a chunk's delta."""
        if delta.index is None:
            return cls(content=delta.content)
        if delta.id is not None:
            call = ToolCallDelta(index=delta.index, id=delta.id, type="function",
                                 function=FunctionCallDelta(name=delta.name, arguments=""))
        else:
            call = ToolCallDelta(index=delta.index, function=FunctionCallDelta(arguments=delta.arguments))
        return cls(tool_calls=[call])


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
