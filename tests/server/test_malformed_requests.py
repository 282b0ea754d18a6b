"""Malformed requests are refused with each API's 4xx, never a 5xx: strings that are not Unicode text (lone
surrogates, NUL), non-finite or degenerate numbers, bad chat messages; an unexpected exception is a 500 in the
API's shape with the request id. A property-based fuzz over the routes checks the classes, not samples:
LORAPLEX_FUZZ_EXAMPLES (default 50 here) examples per route; the full fuzz is LORAPLEX_FUZZ_EXAMPLES=150."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

GOOD = {
    "/generate": {"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
    "/tokenize": {"inputs": "Hello"},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def client(embedded):
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096)))
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c
    engine.shutdown()


def post(client: TestClient, path: str, body) -> "httpx.Response":  # noqa: F821
    """The body as Python's json writes it: lone surrogates escaped, NaN and Infinity as literals (as some
    clients send them), which httpx's own encoder would refuse to send."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def refused(response, path: str, field: str) -> None:
    if path.startswith("/v1/"):
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"] + str(response.json()["error"]["param"])
    else:
        assert response.status_code == 422, response.text
        assert response.json()["error_type"] == "validation" and field in response.json()["error"]


def finite_json(text: str) -> None:
    """Strict JSON: no NaN or Infinity anywhere."""
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-finite number {c} in {text[:200]}"))


# ---- strings -------------------------------------------------------------------------------------

BAD_STRINGS = ["\ud800", "a\udfffb", "nul\x00byte"]
STRING_FIELDS = [  # (route, body with the bad string at X, the field the error names)
    ("/v1/completions", {"prompt": "X", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "X"], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["X"], "max_tokens": 1}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "X"}], "max_tokens": 1}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "X"}]}],
                              "max_tokens": 1}, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format":
                              {"type": "json_schema", "json_schema": {"schema": {"title": "X"}}}}, "response_format"),
    ("/tokenize", {"inputs": "X"}, "inputs"),
    ("/generate", {"inputs": "X", "parameters": {"max_new_tokens": 1}}, "inputs"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["X"], "max_new_tokens": 1}}, "stop"),
    ("/generate_stream", {"inputs": "X", "parameters": {"max_new_tokens": 1}}, "inputs"),
    ("/", {"inputs": "hi", "parameters": {"adapter_id": "X", "max_new_tokens": 1}}, "adapter_id"),
]


def put(body, bad: str):
    if body == "X":
        return bad
    if isinstance(body, dict):
        return {k: put(v, bad) for k, v in body.items()}
    if isinstance(body, list):
        return [put(v, bad) for v in body]
    return body


@pytest.mark.parametrize("bad", BAD_STRINGS, ids=["surrogate", "surrogate-inside", "nul"])
@pytest.mark.parametrize("path,body,field", STRING_FIELDS, ids=[f"{p}:{f}" for p, _, f in STRING_FIELDS])
def test_strings_that_are_not_text_are_refused_naming_the_field(client, path, body, field, bad):
    refused(post(client, path, put(body, bad)), path, field)


def test_native_chat_template_messages_are_checked_after_parsing(client):
    """`inputs` is JSON text: a surrogate escaped inside it appears only once it is parsed."""
    inputs = '[{"role": "user", "content": "\\ud800"}]'
    body = {"inputs": inputs, "parameters": {"apply_chat_template": True, "max_new_tokens": 1}}
    refused(post(client, "/generate", body), "/generate", "content")


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/tokenize", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content", [b"+\xff\x1ch\xc3h\xff\x12", b'{"inputs": "\xff"}'], ids=["bytes", "json-not-utf8"])
def test_body_that_is_not_utf8_is_a_validation_error(client, path, content):
    """FastAPI's own 400 for a body it cannot decode was a native 400 `error_type: http` (a code the native API
    does not use for validation); now as a body that is not JSON: 422 validation (OpenAI: 400)."""
    answer = client.post(path, content=content, headers={"content-type": "application/json"})
    if path.startswith("/v1/"):
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", answer.text
    else:
        assert answer.status_code == 422 and answer.json()["error_type"] == "validation", answer.text


@pytest.mark.parametrize("path,body,field", [
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["ok", ""], "max_new_tokens": 1}}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "", "max_tokens": 1}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [""], "max_tokens": 1}, "stop"),
    ("/v1/completions", {"prompt": [5, -1], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[5], []], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
])
def test_what_the_schema_states_is_refused(client, path, body, field):
    """Empty stop sequences, negative token ids and empty prompt lists are refused by the request models (so the
    OpenAPI document states them, and the schema fuzz does not generate them as valid)."""
    refused(post(client, path, body), path, field)
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert schema["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]["minimum"] == 0


# ---- chat messages on the native route -----------------------------------------------------------

@pytest.mark.parametrize("messages,field", [
    ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": {"a": 1}}], "content"),
    ([{"role": None, "content": "hi"}], "role"),
    ([{"role": "", "content": "hi"}], "role"),
    ([{"role": "wizard", "content": "hi"}], "role"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text"),
    ([{"role": "user", "content": "hi"}, {"role": 7}], "role"),
])
def test_native_chat_messages_are_checked_by_schema(client, messages, field):
    body = {"inputs": json.dumps(messages), "parameters": {"apply_chat_template": True, "max_new_tokens": 1}}
    refused(post(client, "/generate", body), "/generate", field)


def test_native_chat_messages_still_served(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"inputs": json.dumps(messages), "parameters": {"apply_chat_template": True, "max_new_tokens": 1}}
    assert post(client, "/generate", body).status_code == 200
    # Not a list of messages: the text itself is the user's turn, as before.
    body["inputs"] = '{"role": "user"}'
    assert post(client, "/generate", body).status_code == 200


# ---- numbers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": "X"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_p": "X"}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "repetition_penalty": "X"},
     "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {"1": "X"}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_json": {"maximum": "X"}}, "guided_json"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1, "temperature": "X"}}, "temperature"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1, "merged_adapters":
                                                  {"ids": ["a"], "weights": ["X"]}}}, "weights"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1, "repetition_penalty": "X"}},
     "repetition_penalty"),
])
def test_non_finite_numbers_are_refused(client, path, body, field, value):
    refused(post(client, path, put(body, value)), path, field)


@pytest.mark.parametrize("value", [1e-300, 1e-45, 5e-6])
def test_tiny_temperature_is_greedy(client, value):
    """Below 1e-5 (vLLM's _SAMPLING_EPS) a temperature is greedy: the same answer as temperature 0, and
    finite logprobs (dividing by it overflowed the logits to NaN)."""
    chat = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 2}
    greedy = post(client, "/v1/chat/completions", {**chat, "temperature": 0})
    tiny = post(client, "/v1/chat/completions", {**chat, "temperature": value})
    assert tiny.status_code == 200, tiny.text
    finite_json(tiny.text)
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
    native = {"inputs": "Count to five:", "parameters": {"max_new_tokens": 4, "details": True, "temperature": value,
                                                          "return_k_alternatives": 2, "decoder_input_details": True}}
    answer = post(client, "/generate", native)
    assert answer.status_code == 200, answer.text
    finite_json(answer.text)
    plain = post(client, "/generate", {"inputs": "Count to five:", "parameters": {"max_new_tokens": 4}})
    assert answer.json()["generated_text"] == plain.json()["generated_text"]
    with client.stream("POST", "/generate_stream", content=json.dumps(native),
                       headers={"content-type": "application/json"}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                finite_json(line[5:])


@pytest.mark.parametrize("value", [1e-45, 1e-300, 1e-4, 1e300])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_degenerate_repetition_penalty_is_refused(client, path, value):
    body = ({"inputs": "hi", "parameters": {"repetition_penalty": value, "max_new_tokens": 1}} if path == "/generate"
            else {"prompt": "hi", "repetition_penalty": value, "max_tokens": 1})
    refused(post(client, path, body), path, "repetition_penalty")


def test_ordinary_repetition_penalty_still_served(client):
    body = {"inputs": "hi hi hi", "parameters": {"repetition_penalty": 0.5, "max_new_tokens": 2, "details": True}}
    answer = post(client, "/generate", body)
    assert answer.status_code == 200
    finite_json(answer.text)


def test_response_logprobs_are_finite():
    """-inf (a masked token) and NaN become the one finite floor JSON can carry."""
    from loraplex.params import TokenInfo
    from loraplex.protocol.native import Token
    from loraplex.protocol.base import MIN_LOGPROB
    from loraplex.protocol.openai_responses import TopLogprob, logprob

    for value in (-math.inf, math.nan, math.inf):
        assert logprob(value) == MIN_LOGPROB
        assert Token.of(TokenInfo(1, "a", value)).logprob == MIN_LOGPROB
        assert TopLogprob(token="a", logprob=value).logprob == MIN_LOGPROB
    assert Token.of(TokenInfo(1, "a", None)).logprob is None  # the first prompt token has none


# ---- unexpected exceptions -----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_unexpected_exception_is_a_500_in_the_api_shape(client, path, monkeypatch, caplog):
    state = client.app.state.loraplex

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(state.tokenizer, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="loraplex.server"):
        answer = post(client, path, GOOD[path])
    assert answer.status_code == 500
    request_id = answer.headers["x-request-id"]
    if path.startswith("/v1/"):
        error = answer.json()["error"]
        assert error["type"] == "server_error" and request_id in error["message"]
    else:
        assert answer.json()["error_type"] == "internal" and request_id in answer.json()["error"]
    assert "boom" not in answer.text  # internals stay in the log
    record = next(r for r in caplog.records if r.name == "loraplex.server")
    assert request_id in record.getMessage() and record.exc_info[1].args == ("boom",)
    monkeypatch.undo()
    assert post(client, path, GOOD[path]).status_code == 200


# ---- unknown fields ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", list(GOOD))
def test_unknown_fields_are_ignored_on_both_apis(client, path):
    body = {**GOOD[path], "no_such_field": {"x": [1]}}
    assert post(client, path, body).status_code == 200


ADAPTER_SOURCE = {
    "/generate": {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "adapter_id": "org/adapter",
                                                    "adapter_source": "ftp"}},
    "/v1/completions": {"model": "org/adapter", "prompt": "Hello", "max_tokens": 2, "adapter_source": "ftp"},
    "/v1/chat/completions": {"model": "org/adapter", "messages": [{"role": "user", "content": "Hello"}],
                             "max_tokens": 2, "adapter_source": "ftp"},
}


@pytest.mark.parametrize("path", list(ADAPTER_SOURCE))
def test_an_unserved_adapter_source_is_refused_the_same_way_on_both_apis(client, path):
    response = post(client, path, ADAPTER_SOURCE[path])
    assert response.status_code == (400 if path.startswith("/v1/") else 422), response.text
    assert "adapter_source 'ftp' is not served" in response.text


# ---- fuzz ----------------------------------------------------------------------------------------

FIELDS = {
    "/generate": ["inputs", "parameters"],
    "/tokenize": ["inputs", "add_special_tokens"],
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "echo",
                        "best_of", "logit_bias", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
                        "response_format", "guided_choice", "frequency_penalty", "model"],
    "/v1/chat/completions": ["messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                             "top_logprobs", "tools", "tool_choice", "response_format", "repetition_penalty",
                             "min_p", "stop_token_ids"],
}
PARAMETERS = ["max_new_tokens", "temperature", "top_k", "top_p", "typical_p", "min_p", "repetition_penalty",
              "frequency_penalty", "stop", "seed", "truncate", "details", "decoder_input_details", "do_sample",
              "return_k_alternatives", "apply_chat_template", "best_of", "response_format", "return_full_text"]
MAX_TOKENS = {"max_tokens", "max_new_tokens", "max_completion_tokens"}
NUMBERS = [0, 1, -1, 2, 0.5, 1e-45, 1e-300, 5e-324, 1e300, -1e300, 2**63, 2**64, -(2**63) - 1, 10**30,
           math.inf, -math.inf, math.nan]

strings = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["\ud800", "\udfff", "a\x00", "", " ", "user", "assistant", "text", "json_object", "function",
                     '[{"role": "user", "content": 5}]', '[{"role": null}]', '[{"role": "user", "content": "hi"}]']),
)
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(), st.floats(), strings)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(strings, st.sampled_from(["role", "content", "type"])),
                                                 inner, max_size=4)), max_leaves=12)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), values)},
                                optional={"content": values, "name": values, "tool_calls": values})


def small(body, top=True):
    """Generation stays cheap: max tokens (2 when not given), n and best_of clamped (non-integers pass through:
    the fuzz's point)."""
    if isinstance(body, dict):
        out = {k: small(v, top=False) for k, v in body.items()}
        if top:
            out.setdefault("max_tokens", 2)
            if isinstance(out.get("parameters"), dict):
                out["parameters"].setdefault("max_new_tokens", 2)
        for key in MAX_TOKENS | {"n", "best_of"}:
            if isinstance(out.get(key), int) and not isinstance(out[key], bool):
                out[key] = max(-1, min(out[key], 2))
        return out
    return body


def fields(names, extra=()):
    return st.dictionaries(st.sampled_from([*names, *extra]), values, max_size=6)


BODIES = {
    "/generate": st.fixed_dictionaries({"inputs": strings}, optional={"parameters": fields(PARAMETERS)}),
    "/tokenize": fields(FIELDS["/tokenize"]) | st.fixed_dictionaries({"inputs": strings}),
    "/v1/completions": st.fixed_dictionaries({"prompt": st.one_of(strings, values)}).flatmap(
        lambda b: fields(FIELDS["/v1/completions"]).map(lambda f: {**b, **f})),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}).flatmap(
        lambda b: fields(FIELDS["/v1/chat/completions"]).map(lambda f: {**b, **f})),
}
FUZZED: Counter = Counter()
EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "50"))


@pytest.mark.parametrize("path", list(BODIES))
def test_fuzzed_bodies_never_answer_5xx(client, path):
    failures = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=st.one_of(BODIES[path], values))
    def fuzz(body):
        body = small(body)
        answer = post(client, path, body)
        FUZZED[path, answer.status_code // 100] += 1
        if answer.status_code >= 500:
            failures.append((answer.status_code, body, answer.text[:200]))
        elif answer.status_code == 200 and path != "/tokenize":
            finite_json(answer.text)

    fuzz()
    print(f"\nfuzzed {path}: " + ", ".join(f"{n} x {k}xx" for (p, k), n in sorted(FUZZED.items()) if p == path))
    assert post(client, path, GOOD[path]).status_code == 200  # still serving
    assert not failures, f"{len(failures)} 5xx, e.g. {failures[:3]}"
