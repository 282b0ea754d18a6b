"""Structured output through the LoRAX-native API: lorax-client's `response_format` (its JSON-schema form)
and raw HTTP (any JSON object, the json_schema form, the stream) answer valid JSON ending on "eos_token";
cut by max_new_tokens they end on "length"; unusable schemas are 422s naming the problem, as LoRAX
answers validation errors."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from lorax import Client
from lorax.errors import ValidationError

from tests.server.conftest import GRAMMAR_BYTES

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PROMPT = "Describe a person as JSON."


@pytest.fixture(scope="module")
def client(grammar_server):
    return Client(grammar_server, timeout=300)


def test_lorax_client_response_format(client):
    fmt = {"type": "json_object", "schema": PERSON}
    answer = client.generate(PROMPT, max_new_tokens=48, response_format=fmt)
    jsonschema.validate(json.loads(answer.generated_text), PERSON)
    assert answer.details.finish_reason.value == "eos_token"
    events = list(client.generate_stream(PROMPT, max_new_tokens=48, response_format=fmt))
    assert "".join(e.token.text for e in events) == events[-1].generated_text == answer.generated_text
    assert events[-1].details.finish_reason.value == "eos_token"
    cut = client.generate(PROMPT, max_new_tokens=3, response_format=fmt)
    assert cut.details.finish_reason.value == "length" and cut.details.generated_tokens == 3


def generate(server: str, response_format: dict, max_new_tokens: int = 48, inputs: str = PROMPT) -> httpx.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "details": True, "response_format": response_format}}
    return httpx.post(f"{server}/generate", json=body, timeout=300)


def test_raw_forms_and_stream(grammar_server):
    anything = generate(grammar_server, {"type": "json_object"}, inputs="Name a colour as JSON.").json()
    assert isinstance(json.loads(anything["generated_text"]), dict) and anything["details"]["finish_reason"] == "eos_token"
    for fmt in ({"type": "json_schema", "schema": PERSON}, {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}):
        jsonschema.validate(json.loads(generate(grammar_server, fmt).json()["generated_text"]), PERSON)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 48, "response_format": {"type": "json_object", "schema": PERSON}}}
    with httpx.stream("POST", f"{grammar_server}/generate_stream", json=body, timeout=300) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    jsonschema.validate(json.loads("".join(e["token"]["text"] for e in events)), PERSON)
    assert events[-1]["details"]["finish_reason"] == "eos_token"


def test_unusable_and_oversized_schemas_are_422s(grammar_server, client):
    with pytest.raises(ValidationError, match="objectx"):
        client.generate(PROMPT, response_format={"type": "json_object", "schema": {"type": "objectx"}})
    for fmt, words in [
        ({"type": "json_object", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}, "minimum (3) is greater than maximum (1)"),
        ({"type": "xml"}, "text, json_object or json_schema"),
        ({"type": "json_schema"}, "needs its schema"),
        ({"type": "json_object", "schema": {"enum": [f"option number {i}" for i in range(GRAMMAR_BYTES // 16)]}},
         f"must be <= {GRAMMAR_BYTES} (max grammar bytes)"),
    ]:
        answer = generate(grammar_server, fmt)
        assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
        assert words in answer.json()["error"]
