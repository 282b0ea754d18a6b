"""Tool calls through the OpenAI chat API, with the real `openai` client against a live server (SmolLM2's
template ignores tools, so the default rendering is in play): a named function and "required" answer calls
whose arguments validate against their function's schema, streamed (accumulated by the client's own stream
state) and not; "none" answers text; a conversation with a call and its result is rendered with the result
in the prompt; bad tool definitions and choices are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import AutoTokenizer

from loraplex.checkpoints.sources import resolve_model
from loraplex.protocol.tools.prompt import default_rendering
from loraplex.tokenizer import Tokenizer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def function(name: str, description: str, **properties) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = function("get_weather", "Current weather in a city", city={"type": "string", "maxLength": 20},
                   unit={"enum": ["celsius", "fahrenheit"]})
CLOCK = function("get_time", "Current time in a timezone", timezone={"type": "string", "maxLength": 20})
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(grammar_server):
    with openai.OpenAI(base_url=f"{grammar_server}/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


def ask(client, messages=ASK, **fields):
    return client.chat.completions.create(
        **{"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 64, **fields})


def check_calls(message, names: set[str]) -> list:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(client, **fields):
    """The raw chunks, and the completion the client's own stream state accumulates from them."""
    chunks = list(ask(client, stream=True, **fields))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return chunks, state.current_completion_snapshot.choices[0]  # (the final form refuses "length" answers)


@pytest.mark.parametrize("choice, names", [(NAMED, {"get_weather"}), ("required", set(SCHEMAS))], ids=["named", "required"])
def test_constrained_choices_answer_valid_calls_streamed_and_not(client, choice, names):
    answer = ask(client, tool_choice=choice).choices[0]
    assert answer.finish_reason == "tool_calls"
    calls = check_calls(answer.message, names)
    chunks, accumulated = streamed(client, tool_choice=choice)
    assert accumulated.finish_reason == "tool_calls" and check_calls(accumulated.message, names) == calls
    first = chunks[1].choices[0].delta.tool_calls[0]  # after the role chunk: the first call opens
    assert (first.index, first.type, first.function.arguments) == (0, "function", "") and first.id and first.function.name
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) > len(calls) + 1  # arguments came in pieces


def test_one_call_when_parallel_calls_are_off(client):
    answer = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(check_calls(answer.message, set(SCHEMAS))) == 1


def test_none_answers_text_and_auto_streams_as_it_answers(client):
    plain = ask(client, tool_choice="none", max_tokens=12).choices[0]
    assert plain.message.content and plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
    auto = ask(client, tool_choice="auto", max_tokens=24).choices[0]
    _, accumulated = streamed(client, tool_choice="auto", max_tokens=24)
    assert accumulated.message.content == auto.message.content and accumulated.finish_reason == auto.finish_reason
    assert (auto.finish_reason == "tool_calls") == bool(auto.message.tool_calls)


def test_a_conversation_with_a_call_and_its_result(client):
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = ask(client, messages=conversation, tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.content
    # The prompt the server built is the default rendering of the conversation, tool result included.
    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(resolve_model(None).path))
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    prompt = tokenizer.apply_chat_template(default_rendering(messages, None))
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in prompt
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    offered = ask(client, messages=conversation, tool_choice="auto", max_tokens=1)
    with_tools = tokenizer.apply_chat_template(default_rendering(messages, TOOLS))
    assert offered.usage.prompt_tokens == len(tokenizer.encode(with_tools, add_special_tokens=False))


def bad(client, **fields) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    return error.value.body


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", "Field required"),
    ({"tools": [function("f", "x", a={"type": "objectx"})]}, "tools[0].function.parameters", "objectx"),
    ({"tools": [function("f", "x", a={"type": "objectx"})], "tool_choice": "none"}, "tools[0].function.parameters", "objectx"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters", "dictionary"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice", "'get_stock', which is not among"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "none"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "at most one output constraint"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id", "needs tool_call_id"),
])
def test_bad_tools_are_400s(client, fields, param, words):
    body = bad(client, **fields)
    assert body["param"].startswith(param) and words in body["message"]
