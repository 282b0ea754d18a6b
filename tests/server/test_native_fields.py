"""TGI's GenerateParameters on the native routes: each field served as TGI defines it, or refused by name (422),
never accepted and ignored. top_n_tokens: `details.top_tokens` (one list per generated token, best first) and a
stream event's `top_tokens`, from the same engine alternatives as LoRAX's return_k_alternatives, each field
showing its own count; watermark=true refused; TGI's `grammar` (json / regex) served as structured output.
Fields no peer defines are ignored (and logged at debug level)."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.protocol.native import MAX_TOP_N_TOKENS
from loraplex.server.app import create_app

PROMPT = "One, two, three,"
N = 3


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig())) as c:
        yield c


def generate(client, path="/generate", **parameters):
    return client.post(path, json={"inputs": PROMPT, "parameters": parameters})


def stream(client, **parameters) -> list[dict]:
    body = json.dumps({"inputs": PROMPT, "parameters": parameters})
    with client.stream("POST", "/generate_stream", content=body, headers={"content-type": "application/json"}) as r:
        assert r.status_code == 200
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


def refused(response, field: str) -> str:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation" and field in body["error"], body
    return body["error"]


def check_top(token: dict, top: list[dict], n: int = N) -> None:
    """n entries of {id, text, logprob, special}, best first; the chosen token's logprob where it is listed."""
    assert len(top) == n
    assert all(set(t) == {"id", "text", "logprob", "special"} for t in top)
    logprobs = [t["logprob"] for t in top]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)
    listed = [t for t in top if t["id"] == token["id"]]
    if listed:
        assert listed[0]["logprob"] == pytest.approx(token["logprob"], abs=1e-5)


def test_top_n_tokens_in_details(client):
    answer = generate(client, max_new_tokens=4, details=True, top_n_tokens=N)
    assert answer.status_code == 200, answer.text
    details = answer.json()["details"]
    assert len(details["top_tokens"]) == len(details["tokens"]) == details["generated_tokens"] == 4
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert "alternative_tokens" not in token  # LoRAX's field only when return_k_alternatives asks for it
        check_top(token, top)
        assert top[0]["id"] == token["id"]  # greedy: the chosen token is the best one
    # The engine's alternatives, as return_k_alternatives shows them in the same request (more of them: each
    # field shows its own count), and as a request that asks only for them shows them.
    both = generate(client, max_new_tokens=4, details=True, top_n_tokens=N, return_k_alternatives=N + 2,
                    decoder_input_details=True).json()["details"]
    assert both["tokens"] and [t["id"] for t in both["tokens"]] == [t["id"] for t in details["tokens"]]
    for token, top, alone in zip(both["tokens"], both["top_tokens"], details["top_tokens"]):
        assert len(token["alternative_tokens"]) == N + 2
        assert top == token["alternative_tokens"][:N]
        assert [t["id"] for t in top] == [t["id"] for t in alone]
        assert [t["logprob"] for t in top] == pytest.approx([t["logprob"] for t in alone], abs=1e-4)
    # Prefill tokens as before: no top tokens (TGI gives prompt tokens none).
    assert both["prefill"] and all(set(t) == {"id", "text", "logprob", "special"} for t in both["prefill"])
    # Without top_n_tokens (or with 0) no top_tokens field, as TGI skips an empty one.
    for asked in ({}, {"top_n_tokens": 0}):
        plain = generate(client, max_new_tokens=2, details=True, **asked).json()["details"]
        assert "top_tokens" not in plain


def test_top_n_tokens_sampled_and_best_of(client):
    answer = generate(client, max_new_tokens=4, details=True, top_n_tokens=N, do_sample=True, temperature=1.5,
                      best_of=2)
    assert answer.status_code == 200, answer.text
    details = answer.json()["details"]
    for sequence in (details, *details["best_of_sequences"]):
        assert len(sequence["top_tokens"]) == len(sequence["tokens"])
        for token, top in zip(sequence["tokens"], sequence["top_tokens"]):
            check_top(token, top)


def test_top_n_tokens_streamed(client):
    events = stream(client, max_new_tokens=4, top_n_tokens=N)
    details = generate(client, max_new_tokens=4, details=True, top_n_tokens=N).json()["details"]
    assert len(events) == 4 and events[-1]["details"]["generated_tokens"] == 4
    for event, token, top in zip(events, details["tokens"], details["top_tokens"]):
        assert "alternative_tokens" not in event["token"]
        check_top(event["token"], event["top_tokens"])
        assert event["token"]["id"] == token["id"]
        assert [t["id"] for t in event["top_tokens"]] == [t["id"] for t in top]
        assert [t["logprob"] for t in event["top_tokens"]] == pytest.approx([t["logprob"] for t in top], abs=1e-4)
    with_alternatives = stream(client, max_new_tokens=2, top_n_tokens=1, return_k_alternatives=2)
    for event in with_alternatives:
        assert len(event["top_tokens"]) == 1 and len(event["token"]["alternative_tokens"]) == 2
        assert event["top_tokens"][0] == event["token"]["alternative_tokens"][0]
    assert all("top_tokens" not in e for e in stream(client, max_new_tokens=2))


def test_top_n_tokens_on_the_compat_routes(client):
    for path in ("/", "/invocations"):
        answer = generate(client, path, max_new_tokens=2, details=True, top_n_tokens=2)
        assert answer.status_code == 200, answer.text
        details = answer.json()[0]["details"]
        assert [len(top) for top in details["top_tokens"]] == [2, 2]
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2, "top_n_tokens": 2}}
    with client.stream("POST", "/", content=json.dumps(body), headers={"content-type": "application/json"}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [len(e["top_tokens"]) for e in events] == [2, 2]


def test_top_n_tokens_bounds(client):
    message = refused(generate(client, max_new_tokens=1, top_n_tokens=MAX_TOP_N_TOKENS + 1), "top_n_tokens")
    assert str(MAX_TOP_N_TOKENS) in message
    refused(generate(client, max_new_tokens=1, top_n_tokens=-1), "top_n_tokens")
    refused(generate(client, max_new_tokens=1, top_n_tokens=1.5), "top_n_tokens")
    top = generate(client, max_new_tokens=1, details=True, top_n_tokens=MAX_TOP_N_TOKENS).json()["details"]
    assert [len(t) for t in top["top_tokens"]] == [MAX_TOP_N_TOKENS]


def test_watermark_true_is_refused_by_name(client):
    for path in ("/generate", "/", "/invocations"):
        message = refused(generate(client, path, max_new_tokens=1, watermark=True), "watermark")
        assert "not served" in message
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "watermark": True}})
    response = client.post("/generate_stream", content=body, headers={"content-type": "application/json"})
    refused(response, "watermark")
    assert generate(client, max_new_tokens=1, watermark=False).status_code == 200  # TGI clients' default


PAIR = {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"type": "integer"}}}


def test_tgi_grammar_is_served(client):
    digits = generate(client, max_new_tokens=8, grammar={"type": "regex", "value": "[0-9]{3}"}).json()
    assert re.fullmatch("[0-9]{3}", digits["generated_text"]), digits
    for grammar in ({"type": "json", "value": PAIR}, {"type": "json", "value": json.dumps(PAIR)},
                    {"type": "json_object", "value": PAIR},
                    {"type": "json_schema", "value": {"name": "pair", "schema": PAIR}}):
        answer = generate(client, max_new_tokens=16, details=True, grammar=grammar)
        assert answer.status_code == 200, answer.text
        assert answer.json()["details"]["finish_reason"] == "eos_token", (grammar, answer.json())
        jsonschema.validate(json.loads(answer.json()["generated_text"]), PAIR)
    events = stream(client, max_new_tokens=8, grammar={"type": "regex", "value": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", events[-1]["generated_text"])


def test_tgi_grammar_refusals_name_the_field(client):
    refused(generate(client, max_new_tokens=1, grammar={"type": "xml", "value": "<a/>"}), "parameters.grammar.type")
    refused(generate(client, max_new_tokens=1, grammar={"type": "regex"}), "parameters.grammar.value")
    refused(generate(client, max_new_tokens=1, grammar={"type": "regex", "value": 5}), "parameters.grammar.value")
    refused(generate(client, max_new_tokens=1, grammar={"type": "json", "value": 5}), "parameters.grammar.value")
    refused(generate(client, max_new_tokens=1, grammar={"type": "json", "value": "{not json"}),
            "parameters.grammar.value")
    refused(generate(client, max_new_tokens=1, grammar={"type": "json_schema", "value": {"name": "x"}}),
            "parameters.grammar.value")
    refused(generate(client, max_new_tokens=1, grammar={"type": "regex", "value": "[0-9"}), "parameters.grammar")
    both = generate(client, max_new_tokens=1, grammar={"type": "json", "value": PAIR},
                    response_format={"type": "json_object"})
    message = refused(both, "parameters.grammar")
    assert "parameters.response_format" in message


def test_fields_no_peer_defines_are_ignored_and_logged(client, caplog):
    with caplog.at_level(logging.DEBUG, logger="loraplex.protocol.native"):
        answer = client.post("/generate", json={"inputs": PROMPT, "made_up_top": 1,
                                                "parameters": {"max_new_tokens": 1, "made_up_field": True}})
    assert answer.status_code == 200, answer.text
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "made_up_field" in logged and "made_up_top" in logged
