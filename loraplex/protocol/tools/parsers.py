"""Tool calls out of a model's text, piece by piece: each parser takes the answer's text as it streams
(`feed`) and at its end (`end`), and gives `Delta`s: plain text, a call's opening (its index, id and name),
pieces of a call's arguments. A whole answer is parsed by feeding it at once (`parse`), so streamed and
unstreamed answers come out of the same code.

- `NamedCallParser`: a named tool_choice; the whole answer is the function's arguments (constrained).
- `CallArrayParser`: tool_choice "required"; the answer is `[{"name": ..., "arguments": {...}}, ...]`
  (constrained), arguments streamed as they come.
- `TaggedCallParser`: Hermes / Qwen style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
  default format (tool_choice "auto"); text outside the tags is content; a call is held until it closes.
- `JsonCallParser`: Llama 3.1 style `{"name": ..., "parameters": {...}}` (several joined by ';'), the whole
  answer held once it starts with '{'.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's "a tool call follows" token (gone when special tokens are skipped)


@dataclass(frozen=True)
class Delta:
    """Text (`content`), or news of call `index`: its opening (`id` and `name` set) or a piece of its arguments."""

    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    def __init__(self) -> None:
        self.calls = 0  # calls opened so far

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def end(self) -> list[Delta]:
        return []

    def _open(self, name: str) -> Delta:
        self.calls += 1
        return Delta(index=self.calls - 1, id=new_call_id(), name=name)

    def _whole_call(self, name: str, arguments: str) -> list[Delta]:
        opening = self._open(name)
        return [opening, Delta(index=opening.index, arguments=arguments)]


def parse(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when it is only calls) and its calls."""
    return collect([*parser.feed(text), *parser.end()])


def collect(deltas: list[Delta]) -> tuple[str | None, list[ToolCall]]:
    content = "".join(d.content for d in deltas)
    calls: list[ToolCall] = []
    for d in deltas:
        if d.id is not None:
            calls.append(ToolCall(d.id, d.name or "", ""))
        elif d.index is not None:
            calls[d.index].arguments += d.arguments
    if calls and not content.strip():
        return None, calls
    return content, calls


class NamedCallParser(ToolCallParser):
    """The whole answer is one call's arguments (a named tool_choice)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Delta]:
        out = [] if self.calls else [self._open(self.name)]
        return out + ([Delta(index=0, arguments=text)] if text else [])

    def end(self) -> list[Delta]:
        return [] if self.calls else [self._open(self.name)]


class CallArrayParser(ToolCallParser):
    """`[{"name": "f", "arguments": {...}}, ...]`, read one character at a time: depth 1 is the array, depth 2
    a call object, whose "name" string opens the call and whose "arguments" value is passed on as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.string_start = 0
        self._new_call()

    def _new_call(self) -> None:
        self.expect_key = True
        self.key: str | None = None
        self.value_pending = False  # after a key's ':', before its value's first character
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.sent = 0  # how much of the arguments went out
        self.opened: int | None = None  # the call's index, once opened

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._step(i, out)
        self._emit(out)
        return out

    def _step(self, i: int, out: list[Delta]) -> None:
        c = self.text[i]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                self._string_done(json.loads(self.text[self.string_start : i + 1]))
            return
        if self.depth == 2 and self.value_pending and not c.isspace():
            self.value_pending = False
            if self.key == "arguments":
                self.args_start = i
        if self.depth == 2 and c in ",}" and self.args_start is not None and self.args_end is None:
            self.args_end = i
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:  # a call object closed
                self._emit(out)
                self._new_call()
        elif self.depth == 2 and c == ",":
            self.expect_key = True
        elif self.depth == 2 and c == ":":
            self.expect_key, self.value_pending = False, True

    def _string_done(self, value: Any) -> None:
        if self.depth != 2:
            return
        if self.expect_key:
            self.key = value
        elif self.key == "name" and isinstance(value, str):
            self.name = value

    def _emit(self, out: list[Delta]) -> None:
        if self.name is None:
            return  # arguments wait until the call has its name
        if self.opened is None:
            opening = self._open(self.name)
            self.opened = opening.index
            out.append(opening)
        if self.args_start is None:
            return
        upto = self.args_end if self.args_end is not None else len(self.text)
        begin = max(self.args_start, self.sent)
        if upto > begin:
            out.append(Delta(index=self.opened, arguments=self.text[begin:upto]))
            self.sent = upto


def call_of(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class TaggedCallParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` blocks among text. Text that could still begin a tag is held back; a
    block whose JSON is not a call is passed on as text; whitespace next to calls is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text not yet passed on: a possible tag start, or an open call's body
        self.inside = False
        self.space = ""  # trailing whitespace held back: it goes out before more text, or at the end when no call came

    def feed(self, text: str) -> list[Delta]:
        self.pending += text
        out: list[Delta] = []
        while True:
            tag = TOOL_CALL_CLOSE if self.inside else TOOL_CALL_OPEN
            at = self.pending.find(tag)
            if at < 0:
                break
            body, self.pending = self.pending[:at], self.pending[at + len(tag) :]
            out += self._call(body, closed=True) if self.inside else self._text(body)
            self.inside = not self.inside
        if not self.inside:
            keep = _tag_prefix_length(self.pending, TOOL_CALL_OPEN)
            out += self._text(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
        return out

    def end(self) -> list[Delta]:
        out = self._call(self.pending, closed=False) if self.inside else self._text(self.pending)
        self.pending = ""
        if self.space and not self.calls:
            out.append(Delta(content=self.space))
        return out

    def _text(self, text: str) -> list[Delta]:
        """Text goes out but its trailing whitespace, which waits: dropped before a call, sent before more text."""
        text = self.space + text
        kept = text.rstrip()
        self.space = text[len(kept) :]
        return [Delta(content=kept)] if kept else []

    def _call(self, body: str, closed: bool) -> list[Delta]:
        try:
            call = call_of(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:  # not a call after all: the model's text, as it wrote it
            return self._text(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))
        self.space = ""
        return self._whole_call(*call)


def _tag_prefix_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class JsonCallParser(ToolCallParser):
    """Llama 3.1's JSON tool calls: an answer that starts with '{' (perhaps after <|python_tag|>) is held to
    its end and read as calls separated by ';'; any other answer is text, passed on as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.held = ""
        self.mode: str | None = None  # "text" or "json", once the first characters tell

    def feed(self, text: str) -> list[Delta]:
        if self.mode == "text":
            return [Delta(content=text)] if text else []
        self.held += text
        if self.mode is None:
            start = self.held.lstrip()
            if start.startswith(PYTHON_TAG):
                start = start[len(PYTHON_TAG) :].lstrip()
            if start.startswith("{"):
                self.mode = "json"
            elif start and not PYTHON_TAG.startswith(start):
                self.mode, text, self.held = "text", self.held, ""
                return [Delta(content=text)]
        return []

    def end(self) -> list[Delta]:
        text, self.held = self.held, ""
        calls = json_calls(text) if self.mode == "json" else None
        if calls is None:
            return [Delta(content=text)] if text else []
        return [d for call in calls for d in self._whole_call(*call)]


def json_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls written as JSON objects separated by ';' (None unless the whole text is such calls)."""
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return calls or None
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        call = call_of(value)
        if call is None:
            return None
        calls.append(call)


class TextParser(ToolCallParser):
    """No tools in play: the answer is its text."""

    def feed(self, text: str) -> list[Delta]:
        return [Delta(content=text)]
