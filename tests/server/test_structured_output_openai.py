"""Structured output through the OpenAI API, with the real `openai` client against a live server: every
constraint form (response_format json_object / json_schema, LoRAX's schema form, vLLM's guided_* and
structured_outputs) answers output that parses and validates, in chat and completions, streamed and not;
the finish reason says whether the grammar completed; unusable or oversized schemas are 400s naming why."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import GRAMMAR_BYTES

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
CAPITAL = [{"role": "user", "content": 'Reply with a JSON object whose key "answer" is the capital of France.'}]


@pytest.fixture(scope="module")
def client(grammar_server):
    with openai.OpenAI(base_url=f"{grammar_server}/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


def chat(client, messages=ASK, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 48, **fields})


def test_every_constraint_form_answers_valid_output(grammar_server):
    async def main() -> dict:
        async with openai.AsyncOpenAI(base_url=f"{grammar_server}/v1", api_key="x", max_retries=0, timeout=300) as c:
            requests = {  # all at once: the server batches them
                "json_object": chat(c, CAPITAL, response_format={"type": "json_object"}),
                "json_schema": chat(c, response_format=PERSON_FORMAT),
                "lorax schema": chat(c, response_format={"type": "json_object", "schema": PERSON}),
                "guided_json": chat(c, extra_body={"guided_json": PERSON}),
                "structured_outputs": chat(c, extra_body={"structured_outputs": {"json": PERSON}}),
                "guided_regex": chat(c, extra_body={"guided_regex": "[A-Z][a-z]{2,8}"}),
                "guided_choice": chat(c, extra_body={"guided_choice": ["yes", "no"]}),
                "completion": c.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=48, temperature=0,
                                                   extra_body={"response_format": PERSON_FORMAT}),
            }
            return dict(zip(requests, await asyncio.gather(*requests.values())))

    answers = asyncio.run(main())
    text = {name: a.choices[0].text if name == "completion" else a.choices[0].message.content for name, a in answers.items()}
    assert all(a.choices[0].finish_reason == "stop" for a in answers.values()), text
    assert isinstance(json.loads(text["json_object"]), dict)
    for name in ("json_schema", "lorax schema", "guided_json", "structured_outputs", "completion"):
        jsonschema.validate(json.loads(text[name]), PERSON)
    assert re.fullmatch("[A-Z][a-z]{2,8}", text["guided_regex"]) and text["guided_choice"] in ("yes", "no")


def test_streamed_json_joins_to_the_same_valid_answer(client):
    whole = chat(client, response_format=PERSON_FORMAT).choices[0].message.content
    chunks = list(chat(client, response_format=PERSON_FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole), PERSON)
    pieces = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=48, temperature=0, stream=True,
                                       extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads("".join(p.choices[0].text for p in pieces)), PERSON)


def test_max_tokens_inside_the_grammar_is_a_length_finish(client):
    cut = chat(client, response_format=PERSON_FORMAT, max_tokens=4)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4
    assert cut.choices[0].message.content.startswith('{"')
    chunks = list(chat(client, response_format=PERSON_FORMAT, max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as error:
        call()
    assert error.value.status_code == 400
    return error.value


def test_unusable_schemas_are_400s_naming_the_problem(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    error = refused(lambda: chat(client, response_format=bad))
    assert "objectx" in error.body["message"] and error.body["param"] == "response_format"
    error = refused(lambda: chat(client, extra_body={"guided_regex": "(unclosed"}))
    assert "regex" in error.body["message"] and error.body["param"] == "guided_regex"
    error = refused(lambda: chat(client, response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}))
    assert "at most one output constraint" in error.body["message"]
    error = refused(lambda: chat(client, response_format={"type": "xml"}))
    assert "text, json_object or json_schema" in error.body["message"]


def test_a_schema_over_the_size_limit_is_refused_naming_it(client):
    big = {"enum": [f"option number {i}" for i in range(GRAMMAR_BYTES // 16)]}
    assert len(json.dumps(big)) > GRAMMAR_BYTES
    error = refused(lambda: chat(client, extra_body={"guided_json": big}))
    assert f"must be <= {GRAMMAR_BYTES} (max grammar bytes)" in error.body["message"]
    assert chat(client, max_tokens=1).usage.completion_tokens == 1  # and the server still answers
