"""OpenAI API request schemas: /v1/completions, /v1/chat/completions (the shapes vLLM serves; the responses
are in openai_responses.py).

Field ranges are checked here (pydantic: a bad value is a 400 naming the field), and so is what the
server cannot serve yet (`check()` raises `Unsupported` naming the field; the routes answer 400).
Structured output fields become one grammar (protocol/structured_output.py); tools, tool choice and tool
messages are read with protocol/tools/.
Checks that need the server's limits or tokenizer (stop count, prompt length, model name, n) live in
server/openai_routes.py. Unknown fields are ignored, as OpenAI and vLLM do (clients send fields of newer API
versions). Every request model is a `RequestModel` (protocol/base.py): text and finite numbers only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from loraplex.params import SamplingParams
from loraplex.protocol.base import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SAMPLING_EPS,
    RequestModel,
)
from loraplex.protocol.errors import Unsupported
from loraplex.protocol.structured_output import (
    Constraint,
    guided_specs,
    one_constraint,
    response_format_spec,
    structured_outputs_specs,
)
from loraplex.protocol.tools.definitions import ToolChoice, ToolDefinition, ToolPlan, plan_tools

log = logging.getLogger(__name__)

# ---- requests ------------------------------------------------------------------------------------


# Each refused field and the values it is accepted at (its default, meaning "off").
MAX_PROMPT_LOGPROBS = 20  # the likeliest tokens per prompt position (vLLM's default --max-logprobs)

REFUSED_AT: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "early_stopping": (False,), "guided_grammar": (None,),
    "guided_decoding_backend": (None, "auto"), "guided_whitespace_pattern": (None,), "structural_tag": (None,),
    "logits_processors": (None, []), "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False), "priority": (0,), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "mm_processor_kwargs": (None, {}),
}
WHY_REFUSED: dict[str, str] = {
    "use_beam_search": "beam search is not served", "length_penalty": "beam search is not served",
    "early_stopping": "beam search is not served",
    "guided_grammar": "grammars are not served (use guided_json, guided_regex or guided_choice)",
    "guided_decoding_backend": "this server has one structured output backend of its own ('auto')",
    "priority": "priority scheduling is not served",
}
# Chat's own: vLLM's chat extras and OpenAI's chat fields this server does not serve.
CHAT_REFUSED_AT: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "continue_final_message": (None, False), "add_generation_prompt": (None, True),
    "documents": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}), "audio": (None,),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,), "store": (None, False),
    "modalities": (None, ["text"]), "service_tier": (None, "auto", "default"),
}
WHY_REFUSED.update({
    "echo": "echoing the last message is not served", "continue_final_message": "the prompt always opens a new "
    "assistant message", "add_generation_prompt": "the prompt always opens a new assistant message",
    "chat_template": "the model's own template is used", "store": "answers are not stored",
    "modalities": "answers are text", "audio": "answers are text",
})


def refuse_unserved(model: Any, table: dict[str, tuple[Any, ...]]) -> None:
    """Unsupported, naming the first field of `table` set to a value it is not accepted at."""
    for name, accepted in table.items():
        value = getattr(model, name)
        if value not in accepted:
            why = WHY_REFUSED.get(name, "it is not served")
            raise Unsupported(f"{name} is not supported ({why}); got {_shown(value)}", name)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class StreamOptions(RequestModel):
    include_usage: bool = False


StopSequence = Annotated[str, Field(min_length=1)]  # an empty stop sequence would stop before any text


class SamplingFields(RequestModel):
    """What completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=1, ge=1)
    stop: StopSequence | list[StopSequence] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # token id (as a string, as OpenAI's) -> a bias in [-100, 100] added to its logit before sampling, greedy too
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None  # accepted, ignored
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Extensions (the openai client sends them as `extra_body`), as vLLM and LoRAX name them.
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's: at least this many tokens before EOS, a stop token id or a stop string may end the answer; only these
    # token ids may be generated; these words (each tokenized as is and after a space) are never completed.
    min_tokens: int = Field(default=0, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # LoRAX's extras: the adapter (instead of, or the same as, `model`) and where it comes from.
    adapter_id: str | None = None
    adapter_source: str | None = None
    # A Hugging Face token for a private hub adapter: checked with the hub on every request, never logged.
    api_token: str | None = None
    # Structured output: OpenAI's response_format, and vLLM's fields (at most one constraint in all).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Prefix caching: requests share cached prompt blocks only with the same salt (vLLM's field).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: the prompt tokens' logprobs (each one's own, its rank, and this many likeliest tokens); a stop string kept in the text; spaces between special tokens (our detokenizer, as a
    # fast tokenizer's, puts none: both values are served as vLLM serves them with a fast tokenizer); only the
    # last N prompt tokens kept (left truncation); special tokens (BOS) added to the prompt (None: the route's
    # default, as vLLM's: true for completions, false for chat, whose template writes them).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool | None = None
    # vLLM's and OpenAI's fields this server does not serve: accepted at their defaults only (REFUSED_AT below).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    _ignored: list[str] = PrivateAttr(default_factory=list)  # fields no peer defines: ignored, logged by name

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler) -> Any:
        """Remember the fields no API this server follows defines (ignored, as OpenAI and vLLM ignore them)."""
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, SamplingFields):
            model._ignored = sorted(str(k) for k in data if k not in type(model).model_fields)
        return model

    def log_ignored(self) -> None:
        """One debug line naming the request's ignored fields, if any."""
        if self._ignored:
            log.debug("ignored unknown request fields: %s", ", ".join(name[:64] for name in self._ignored[:50]))

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        """Refuse, by name, what the schema accepts but the server cannot serve yet."""
        for key in self.logit_bias or {}:
            if not key.lstrip("-").isdigit():
                raise Unsupported(f"logit_bias keys must be token ids; got {key[:40]!r}", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise Unsupported("allowed_token_ids must not be empty (leave it out to allow every token)",
                              "allowed_token_ids")
        refuse_unserved(self, REFUSED_AT)
        if self.prompt_logprobs is not None and self.stream:
            raise Unsupported("prompt_logprobs is not available when streaming", "prompt_logprobs")
        self.output_constraint()

    def token_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs (`check` made sure the keys are integers)."""
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    def output_constraints(self) -> list[Constraint]:
        """Every constraint on the answer the request asks for, named by its field."""
        fmt = response_format_spec(self.response_format)
        return [
            *([("response_format", fmt)] if fmt is not None else []),
            *guided_specs(self.guided_json, self.guided_regex, self.guided_choice),
            *structured_outputs_specs(self.structured_outputs),
        ]

    def output_constraint(self) -> Constraint | None:
        """The answer's one constraint (Unsupported when there are several)."""
        return one_constraint(self.output_constraints())

    def with_defaults(self, defaults: dict[str, float]) -> "SamplingFields":
        """This request with `defaults` (the model's generation config) in the sampling fields it leaves unset."""
        unset = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        return self.model_copy(update=unset) if unset else self

    def to_sampling_params(self, max_tokens: int, top_n: int = 0, prompt_logprobs: bool = False,
                           prompt_top_n: int = 0) -> SamplingParams:
        """OpenAI semantics: temperature 0 (below SAMPLING_EPS, as vLLM) is greedy (other warpers off); otherwise
        sampling (default 1.0)."""
        greedy = SamplingParams(
            max_new_tokens=max_tokens, seed=self.seed, stop=tuple(self.stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            repetition_penalty=self.repetition_penalty or 1.0, frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0, ignore_eos=self.ignore_eos, top_n_tokens=top_n,
            prompt_logprobs=prompt_logprobs, prompt_top_n=prompt_top_n, skip_special_tokens=self.skip_special_tokens,
            grammar=constraint[1] if (constraint := self.output_constraint()) else None, cache_salt=self.cache_salt,
            logit_bias=self.token_bias(), allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
            min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
        )
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature < SAMPLING_EPS:
            return greedy
        return replace(
            greedy, do_sample=True, temperature=temperature, top_k=max(0, self.top_k or 0), top_p=self.top_p or 1.0,
            min_p=self.min_p or 0.0,
        )


def checked_sampling_defaults(pairs: tuple[tuple[str, float], ...]) -> tuple[dict[str, float], list[str]]:
    """The model's sampling defaults (ModelConfig.sampling_defaults) that a request could set itself, each checked as
    a request's field is, and a line for each one refused."""
    accepted, refused = {}, []
    for name, value in pairs:
        try:
            SamplingFields.model_validate({name: value})
        except ValidationError:
            refused.append(f"generation_config.json: {name} {value!r} is outside what the OpenAI API accepts; ignored")
        else:
            accepted[name] = value
    return accepted, refused


# What the server refuses whatever its model, stated in the schema (so the OpenAPI document says it too): negative
# token ids, an empty list of prompts, a prompt of no token ids. (An empty string may tokenize to a BOS token.)
TokenId = Annotated[int, Field(ge=0)]
Prompt = str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
    list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1)
    # Fill in the middle: served where the tokenizer has FIM tokens (server/openai_inputs.py), else refused.
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None  # vLLM's: refused

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, p: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)

        if not (isinstance(p, str) or ids(p) or isinstance(p, list) and (
                all(isinstance(x, str) for x in p) or all(ids(x) for x in p))):
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token id lists")
        return p

    def check(self) -> None:
        super().check()
        if self.prompt_embeds is not None:
            raise Unsupported("prompt_embeds is not supported (give the prompt as text or token ids)", "prompt_embeds")
        n, best_of = self.choices_per_prompt, self.best_of or self.choices_per_prompt
        if best_of < n:
            raise Unsupported(f"best_of must be >= n; got best_of={best_of}, n={n}", "best_of")
        if self.stream and best_of > n:
            raise Unsupported("best_of > n is not supported when streaming", "best_of")
        if self.stream and self.echo and self.logprobs is not None:
            raise Unsupported("echo with logprobs is not supported when streaming", "echo")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list: of strings, or of token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # one prompt of token ids
        return list(p)


class ContentPart(RequestModel, extra="allow"):
    """One part of a message's content: {"type": "text", "text": ...} or {"type": "image_url",
    "image_url": {"url": ...}}; other types are refused by name."""

    type: str
    text: str | None = None


class FunctionCallIn(RequestModel):
    name: str
    arguments: str  # JSON text


class ToolCallIn(RequestModel):
    """A call an earlier assistant message made."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def for_template(self) -> dict[str, Any]:
        """Hugging Face's shape: templates expect the arguments as an object (kept as text when not JSON)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(RequestModel, extra="allow"):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    def for_template(self, i: int) -> dict[str, Any]:
        """{"role", "content"} for the chat template: text parts joined by newlines, as vLLM does; a
        content list with images keeps its parts (the server turns image_url parts into images). Tool
        calls and tool results in Hugging Face's shape (protocol/tools/prompt.py renders them for templates
        that do not take them)."""
        if self.role == "function":
            raise Unsupported("role 'function' (deprecated by OpenAI) is not supported; use 'tool'", f"messages[{i}].role")
        if self.tool_calls and self.role != "assistant":
            raise Unsupported("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        if self.role == "tool":
            if not self.tool_call_id:
                raise Unsupported("a tool message needs tool_call_id (the call it answers)", f"messages[{i}].tool_call_id")
            return {"role": "tool", "content": self._text(i), "tool_call_id": self.tool_call_id}
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list) and any(part.type == "image_url" for part in self.content):
            return {"role": role, "content": [part.model_dump(exclude_none=True) for part in self.content]}
        message = {"role": role, "content": self._text(i)}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message

    def _text(self, i: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            where = f"messages[{i}].content[{j}]"
            if part.type in ("image", "input_image"):
                raise Unsupported(f"content parts of type {part.type!r} are not supported (use image_url)", where)
            if part.type != "text" or part.text is None:
                raise Unsupported(f"content parts of type {part.type!r} are not supported (text, image_url)", where)
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused
    function_call: Any = None
    # Refused unless at their defaults (CHAT_REFUSED_AT): vLLM's chat extras, OpenAI's fields not served.
    echo: bool | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    documents: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    service_tier: str | None = None

    def check(self) -> None:
        super().check()
        refuse_unserved(self, CHAT_REFUSED_AT)
        if self.functions:
            raise Unsupported("functions (deprecated by OpenAI) are not supported; use tools", "functions")
        if self.function_call not in (None, "none"):
            raise Unsupported("function_call (deprecated by OpenAI) is not supported; use tool_choice", "function_call")
        if self.top_logprobs and not self.logprobs:
            raise Unsupported("top_logprobs needs logprobs: true", "top_logprobs")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def output_constraints(self) -> list[Constraint]:
        """A tool choice that constrains the answer ("required", a named function) counts as a constraint."""
        tools = self.tool_plan().grammar
        return [*super().output_constraints(), *([("tool_choice", tools)] if tools is not None else [])]
