"""What each API's structured output and tool fields become: one grammar per request (or a refusal naming
the field), and for tools a plan whose grammar lets the answer be exactly the calls asked for."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loraplex.params import GrammarSpec
from loraplex.protocol.errors import Unsupported
from loraplex.protocol.native import GenerateParameters
from loraplex.protocol.openai import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON = GrammarSpec("json_schema", json.dumps(SCHEMA))
HI = [{"role": "user", "content": "hi"}]


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


@pytest.mark.parametrize("fields, grammar", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}, JSON),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, JSON),  # LoRAX's OpenAI form
    ({"guided_json": SCHEMA}, JSON),
    ({"guided_json": json.dumps(SCHEMA)}, JSON),
    ({"guided_regex": "[a-z]+"}, GrammarSpec("regex", "[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, GrammarSpec("choice", '["yes", "no"]')),
    ({"structured_outputs": {"json": SCHEMA}}, JSON),
    ({"structured_outputs": {"choice": ["a"], "regex": None}}, GrammarSpec("choice", '["a"]')),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object", "")),
])
def test_openai_fields_become_one_grammar(fields, grammar):
    for body in (ChatCompletionRequest(messages=HI, **fields), CompletionRequest(prompt="hi", **fields)):
        body.check()
        assert body.to_sampling_params(8).grammar == grammar


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one output constraint"),
    ({"guided_json": SCHEMA, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex", "got 2"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs its schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema", "must be a JSON schema"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
])
def test_unservable_constraints_are_refused_by_name(fields, param, words):
    with pytest.raises(Unsupported, match=words) as refused:
        ChatCompletionRequest(messages=HI, **fields).check()
    assert refused.value.param == param


@pytest.mark.parametrize("response_format, grammar", [
    (None, None),
    ({"type": "json_object"}, GrammarSpec("json_object", "")),
    ({"type": "json_object", "schema": SCHEMA}, JSON),
    ({"type": "json_schema", "schema": SCHEMA}, JSON),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, JSON),
])
def test_native_response_format(response_format, grammar):
    assert GenerateParameters(response_format=response_format).to_sampling_params(8).grammar == grammar


def test_tool_choice_constraint_counts_as_one():
    body = ChatCompletionRequest(messages=HI, tools=[tool("f")], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(Unsupported, match="response_format, tool_choice") as refused:
        body.check()
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize("tools, choice, words", [
    ([tool("f")], {"type": "function", "function": {"name": "g"}}, "'g', which is not among the tools"),
    ([], "required", "needs tools"),
    ([], "none", "tool_choice 'none' needs tools"),
    (None, "auto", "needs tools"),
    (None, {"type": "function", "function": {"name": "g"}}, "tool_choice 'g' needs tools"),
    ([tool("f"), tool("f")], "auto", "distinct function names"),
])
def test_bad_tool_choices_are_refused(tools, choice, words):
    with pytest.raises(Unsupported, match=words):
        ChatCompletionRequest(messages=HI, tools=tools, tool_choice=choice).check()


def test_plans_by_choice():
    f, g = tool("f", SCHEMA), tool("g")
    plan = lambda **kw: ChatCompletionRequest(messages=HI, **kw).tool_plan()  # noqa: E731
    assert plan().mode == "none" and plan(tools=[f]).mode == "auto"
    unused = plan(tools=[f], tool_choice="none")
    assert unused.offered == [] and len(unused.schemas()) == 1  # not offered, still checked
    named = plan(tools=[f, g], tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.mode == "named" and named.grammar == JSON
    assert plan(tools=[f, g], tool_choice={"type": "function", "function": {"name": "g"}}).grammar == GrammarSpec("json_schema", '{"type": "object"}')
    assert [name for name, _ in plan(tools=[f, g]).schemas()] == ["tools[0].function.parameters", "tools[1].function.parameters"]


def test_required_grammar_is_one_or_more_calls_of_the_tools():
    plan = ChatCompletionRequest(messages=HI, tools=[tool("f", SCHEMA), tool("g")], tool_choice="required").tool_plan()
    schema = json.loads(plan.grammar.value)
    valid = [[{"name": "f", "arguments": {"a": 1}}], [{"name": "g", "arguments": {}}, {"name": "f", "arguments": {"a": 2}}]]
    invalid = [[], [{"name": "h", "arguments": {}}], [{"name": "f", "arguments": {}}], [{"name": "f"}]]
    for calls in valid:
        jsonschema.validate(calls, schema)
    for calls in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    single = ChatCompletionRequest(messages=HI, tools=[tool("g")], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.tool_plan().grammar.value)["maxItems"] == 1
