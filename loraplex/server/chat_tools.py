"""A chat request's tools at the server: the prompt that offers them, and its answers read as text or as
tool calls (whole, or delta by delta when streamed). The formats live in protocol/tools/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.params import FinishReason
from loraplex.protocol.openai_responses import (
    AssistantMessage,
    DeltaMessage,
    FinishReasonName,
    ToolCallOut,
    finish_reason_name,
)
from loraplex.protocol.tools.definitions import ToolPlan
from loraplex.protocol.tools.parsers import Delta, ToolCallParser, parse
from loraplex.protocol.tools.prompt import default_rendering, writes_json_calls
from loraplex.server.state import ServerState


def chat_prompt(
    state: ServerState, messages: list[dict[str, Any]], plan: ToolPlan, add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt for `messages` with the plan's tools: natively when the tokenizer's chat template renders
    tools, else in the default rendering (protocol/tools/prompt.py). A vision model's processor template
    (the one that places images) always gets the default rendering. The chat route always opens a new assistant
    message; vLLM's /tokenize may ask otherwise (add_generation_prompt, continue_final_message)."""
    offered = [t.model_dump(exclude_none=True) for t in plan.offered] or None
    opening = {"add_generation_prompt": add_generation_prompt}
    if continue_final_message:  # passed only when asked: a template call as it always was otherwise
        opening["continue_final_message"] = True
    processor = state.model.processor
    if processor is not None and getattr(processor, "chat_template", None):
        return processor.apply_chat_template(default_rendering(messages, offered), tokenize=False, **opening)
    tokenizer = state.tokenizer
    if tokenizer.renders_tools:
        return tokenizer.apply_chat_template(messages, tools=offered, **opening)
    return tokenizer.apply_chat_template(default_rendering(messages, offered), **opening)


def with_calls(reason: FinishReasonName, called: bool) -> FinishReasonName:
    """An answer that made calls and ended by itself ends with "tool_calls"; one cut short stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class ToolAnswers:
    """How one chat request's answers are read: the plan's parser, fresh per answer."""

    plan: ToolPlan
    json_calls: bool = False  # the template is Llama 3.1's: its models write bare JSON calls

    @classmethod
    def of(cls, state: ServerState, plan: ToolPlan) -> ToolAnswers:
        native = state.model.processor is None and state.tokenizer.renders_tools
        return cls(plan, native and writes_json_calls(state.tokenizer.hf.chat_template))

    def message(self, text: str, reason: FinishReason | None) -> tuple[AssistantMessage, FinishReasonName]:
        """A whole answer: its message (content and tool calls) and finish reason."""
        content, calls = parse(self.parser(), text)
        tool_calls = [ToolCallOut.of(c) for c in calls] or None
        return AssistantMessage(content=content, tool_calls=tool_calls), with_calls(finish_reason_name(reason), bool(calls))

    def stream(self) -> AnswerStream:
        return AnswerStream(self.parser())

    def parser(self) -> ToolCallParser:
        return self.plan.parser(self.json_calls)


@dataclass
class AnswerStream:
    """One streamed answer: its text pieces in, chunk deltas out."""

    parser: ToolCallParser
    called: bool = field(default=False)

    def content(self, text: str) -> list[DeltaMessage]:
        return self._deltas(self.parser.feed(text))

    def finish(self, reason: FinishReasonName) -> tuple[list[DeltaMessage], FinishReasonName]:
        deltas = self._deltas(self.parser.end())
        return deltas, with_calls(reason, self.called)

    def _deltas(self, parsed: list[Delta]) -> list[DeltaMessage]:
        self.called = self.called or any(d.index is not None for d in parsed)
        return [DeltaMessage.of(d) for d in parsed]
