"""Tool calls read out of answers: every parser gives the same calls and content whether the answer comes
whole or one character at a time (as a stream), and text that is not a call stays text."""

from __future__ import annotations

import json

import pytest

from loraplex.protocol.tools.parsers import (
    CallArrayParser,
    JsonCallParser,
    NamedCallParser,
    TaggedCallParser,
    collect,
    parse,
)


def streamed(parser, text: str):
    """The answer fed one character at a time, then ended: what a stream of it accumulates to."""
    deltas = [d for c in text for d in parser.feed(c)] + parser.end()
    return collect(deltas), deltas


def calls_of(parsed) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parsed
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


TAGGED = {
    "one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 None, [("get_weather", {"city": "Paris"})]),
    "text then two calls": ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                            '<tool_call>{"name": "b", "parameters": {"x": [1, 2]}}</tool_call>',
                            "Let me check.", [("a", {}), ("b", {"x": [1, 2]})]),
    "unclosed at the end": ('<tool_call>{"name": "a", "arguments": {"q": "x"}}', None, [("a", {"q": "x"})]),
    "arguments as a JSON string": ('<tool_call>{"name": "a", "arguments": "{\\"n\\": 1}"}</tool_call>', None, [("a", {"n": 1})]),
    "plain text": ("The weather is <b>fine</b> < tool", "The weather is <b>fine</b> < tool", []),
    "a tag that is not a call": ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    "a call without a name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "whitespace only": ("  \n", "  \n", []),
}


@pytest.mark.parametrize("name", TAGGED)
def test_tagged_calls_whole_and_streamed(name):
    text, content, calls = TAGGED[name]
    assert calls_of(parse(TaggedCallParser(), text)) == (content, calls)
    (streamed_content, streamed_calls), _ = streamed(TaggedCallParser(), text)
    assert calls_of((streamed_content, streamed_calls)) == (content, calls)


def test_tagged_text_streams_before_a_call_and_a_call_comes_whole():
    parser = TaggedCallParser()
    assert [d.content for d in parser.feed("Sure. <tool")] == ["Sure."]  # " <tool" may begin a call: held
    assert parser.feed('_call>{"name": "a", "arguments"') == []  # a call is held until it closes
    opening, arguments = parser.feed(': {"k": 1}}</tool_call>')
    assert (opening.index, opening.name, opening.arguments) == (0, "a", "") and opening.id.startswith("call_")
    assert (arguments.index, arguments.id, json.loads(arguments.arguments)) == (0, None, {"k": 1})


JSON_CALLS = {
    "llama 3.1 call": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    "python tag and two calls": ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"n": 2}}',
                                 None, [("a", {}), ("b", {"n": 2})]),
    "text": ("It is sunny in Oslo.", "It is sunny in Oslo.", []),
    "json that is not a call": ('{"city": "Oslo"}', '{"city": "Oslo"}', []),
    "a call then text": ('{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
}


@pytest.mark.parametrize("name", JSON_CALLS)
def test_json_calls_whole_and_streamed(name):
    text, content, calls = JSON_CALLS[name]
    assert calls_of(parse(JsonCallParser(), text)) == (content, calls)
    parsed, _ = streamed(JsonCallParser(), text)
    assert calls_of(parsed) == (content, calls)


def test_json_call_text_streams_as_it_comes():
    parser = JsonCallParser()
    assert [d.content for d in parser.feed("It")] == ["It"]
    assert [d.content for d in parser.feed(" is")] == [" is"]


ARRAY = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, {"name": "get_time", "arguments": {"tz": "a,b}"}}]'


def test_call_array_streams_arguments_piece_by_piece():
    (content, calls), deltas = streamed(CallArrayParser(), ARRAY)
    assert calls_of((content, calls)) == (None, [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"tz": "a,b}"})])
    openings = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name, d.arguments) for d in openings] == [(0, "get_weather", ""), (1, "get_time", "")]
    pieces = [d for d in deltas if d.id is None]
    assert len(pieces) > 10 and all(len(d.arguments) == 1 for d in pieces)  # one per character fed
    assert deltas.index(openings[1]) > deltas.index(pieces[0])  # each call opens before its arguments come
    assert parse(CallArrayParser(), ARRAY)[1][1].arguments == '{"tz": "a,b}"}'  # the model's text, as written


def test_call_array_cut_short_keeps_what_came():
    content, calls = parse(CallArrayParser(), '[{"name": "f", "arguments": {"a": "par')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": "par')]
    assert parse(CallArrayParser(), '[{"na') == ("", [])


def test_named_call_is_the_whole_answer():
    (content, calls), deltas = streamed(NamedCallParser("f"), '{"x": 1}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    assert (deltas[0].name, deltas[0].arguments) == ("f", "") and deltas[0].id.startswith("call_")
