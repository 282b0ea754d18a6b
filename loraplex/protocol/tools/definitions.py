"""Tools a chat request offers (`tools`), which of them the answer must call (`tool_choice`), and the grammar
that makes it call them.

tool_choice "none": the tools are left out of the prompt and the answer is plain text. "auto" (the default
when tools are given): the model answers freely and calls are parsed from its text. "required": the answer
is constrained to a JSON array of one or more calls `[{"name": ..., "arguments": {...}}]`, each call's
arguments valid for its function's schema. A named function: the answer is constrained to that function's
arguments, a JSON object valid for its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from loraplex.params import GrammarSpec
from loraplex.protocol.base import RequestModel
from loraplex.protocol.errors import Unsupported
from loraplex.protocol.tools.parsers import (
    CallArrayParser,
    JsonCallParser,
    NamedCallParser,
    TaggedCallParser,
    TextParser,
    ToolCallParser,
)

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a function declared without parameters


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule (and a dot, as vLLM allows)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # accepted; "required" and named choices are always enforced, "auto" never

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else ANY_ARGUMENTS


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


def schema_text(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with its tools."""

    mode: Literal["none", "auto", "required", "named"]
    tools: list[ToolDefinition] = field(default_factory=list)  # as the request gave them
    function: str | None = None  # the named function
    parallel: bool = True  # "required": more than one call allowed

    @property
    def offered(self) -> list[ToolDefinition]:
        """The tools the prompt offers ("none": no tools, so the model is not led to call one)."""
        return [] if self.mode == "none" else self.tools

    @property
    def calls_only(self) -> bool:
        """The answer is constrained to tool calls: it has no text content."""
        return self.mode in ("named", "required")

    @property
    def grammar(self) -> GrammarSpec | None:
        """The answer's constraint ("required" and named choices)."""
        if self.mode == "named":
            chosen = next(t.function for t in self.tools if t.function.name == self.function)
            return GrammarSpec("json_schema", schema_text(chosen.arguments_schema))
        if self.mode == "required":
            calls = [
                {"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": t.function.arguments_schema},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for t in self.tools
            ]
            array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
            return GrammarSpec("json_schema", schema_text(array))
        return None

    def parser(self, json_calls: bool = False) -> ToolCallParser:
        """A fresh parser for one answer. `json_calls`: the model was prompted by a Llama 3.1-style template and
        calls tools in bare JSON."""
        if self.mode == "named":
            return NamedCallParser(self.function)
        if self.mode == "required":
            return CallArrayParser()
        if self.mode == "auto":
            return JsonCallParser() if json_calls else TaggedCallParser()
        return TextParser()

    def schemas(self) -> list[tuple[str, GrammarSpec]]:
        """Each given function's arguments schema as a grammar, with its field: the server compiles them all, so
        that a tool it could never constrain is refused whatever the choice."""
        return [
            (f"tools[{i}].function.parameters", GrammarSpec("json_schema", schema_text(t.function.arguments_schema)))
            for i, t in enumerate(self.tools)
        ]


def _shown(choice: ToolChoice) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)


def plan_tools(tools: list[ToolDefinition] | None, choice: ToolChoice, parallel: bool | None) -> ToolPlan:
    """Check `tools` and `tool_choice` together (Unsupported naming the field) and say what to do."""
    tools = list(tools or [])
    names = [t.function.name for t in tools]
    seen: set[str] = set()
    duplicated = next((n for n in names if n in seen or seen.add(n)), None)  # linear: requests may carry many tools
    if duplicated is not None:
        raise Unsupported(f"tools must have distinct function names; {duplicated!r} is given twice", "tools")
    if choice is not None and not tools:  # as OpenAI and vLLM answer: a choice among no tools is a mistake
        raise Unsupported(f"tool_choice {_shown(choice)} needs tools; none are given", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            offered = ", ".join(names) or "none"
            raise Unsupported(
                f"tool_choice names function {choice.function.name!r}, which is not among the tools (offered: {offered})",
                "tool_choice",
            )
        return ToolPlan("named", tools, choice.function.name)
    if choice == "none" or not tools:
        return ToolPlan("none", tools)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel is not False)
    return ToolPlan("auto", tools)
