"""Property-based fuzzing of both APIs from the server's own OpenAPI document (schemathesis).

Every documented operation gets requests generated from its schema, valid ones (positive) and ones that break
it (negative). Whatever is sent: never a 5xx, an error body in the route's API shape, a status code the
document lists, and the server healthy after. Generation is capped so that each request stays cheap: at most
2 new tokens, 2 choices (the cap is the fuzz's, not the server's: the server accepts up to its max total
tokens, which the document states; see test_documented_limits_are_the_servers).

Figures: LORAPLEX_FUZZ_EXAMPLES (default 30) examples per operation and mode; derandomized, so a run is
reproducible and a failure replays.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "30"))
# Every operation the document must list: a new route is fuzzed once it is added here (and the test below fails
# until it is).
OPERATIONS = [
    ("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"), ("POST", "/invocations"),
    ("POST", "/tokenize"), ("GET", "/health"), ("GET", "/ping"), ("GET", "/info"), ("GET", "/metrics"),
    ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/version"), ("POST", "/detokenize"), ("POST", "/v1/embeddings"), ("POST", "/embed"),
]
CAPPED = {"max_new_tokens": 2, "max_tokens": 2, "max_completion_tokens": 2, "n": 2, "best_of": 2}
SENT: Counter = Counter()  # (operation, mode, status class) -> requests


@pytest.fixture(scope="module")
def client(embedded):
    """A server with short limits: generated texts can be long, and a prompt the server takes is computed (a
    4k-token prefill takes the CPU seconds); longer ones are refused with a 4xx, which is part of the fuzz."""
    config = EngineConfig(device="cpu", max_batch_total_tokens=4096, max_input_length=127, max_total_tokens=128)
    engine = AsyncEngine(Engine(embedded, config))
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c
    engine.shutdown()


@pytest.fixture(scope="module")
def schema(client):
    """The document as a client reads it, from /openapi.json."""
    return schemathesis.openapi.from_dict(client.get("/openapi.json").json())


def cheap(body):
    """Integers above the caps lowered to them, and max tokens given (null or absent: the server's default, up to
    the context for chat, would be slow), wherever they sit: top level or native `parameters`. Anything else,
    including a wrong type or a negative number, is sent as generated."""
    if not isinstance(body, dict):
        return body
    out = {}
    for key, value in body.items():
        if key in CAPPED and isinstance(value, int) and not isinstance(value, bool) and value > CAPPED[key]:
            value = CAPPED[key]
        out[key] = cheap(value) if key == "parameters" else value
    if "messages" in out or "prompt" in out:
        for key in ("max_tokens", "max_completion_tokens"):
            if out.get(key) is None:
                out[key] = 2
    if "inputs" in out:
        if out.get("parameters") is None:
            out["parameters"] = {}
        if isinstance(out["parameters"], dict) and out["parameters"].get("max_new_tokens") is None:
            out["parameters"]["max_new_tokens"] = 2
    return out


def send(client: TestClient, case) -> "httpx.Response":  # noqa: F821
    headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "content-length"}
    kwargs = {}
    if isinstance(case.body, bytes):  # a negative case may send what is not JSON at all
        kwargs["content"] = case.body
        headers["content-type"] = case.media_type or "application/octet-stream"
    elif case.body is not NOT_SET:  # Python's json: lone surrogates escaped, as schemathesis generates them
        kwargs["content"] = json.dumps(cheap(case.body))
        headers["content-type"] = case.media_type or "application/json"
    return client.request(case.method, case.formatted_path, params=case.query, headers=headers, **kwargs)


def api_shaped_error(path: str, response) -> None:
    """A 4xx/5xx body in the route's API shape: OpenAI's {"error": {"message", "type", ...}} under /v1/,
    LoRAX's {"error": "...", "error_type": "..."} elsewhere."""
    body = response.json()
    if path.startswith("/v1/"):
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body
    else:
        assert isinstance(body["error"], str) and isinstance(body["error_type"], str), body


def test_document_lists_every_operation(schema):
    documented = {(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())}
    assert documented == set(OPERATIONS)


# Negative cases break the schema; only a body can be broken (a path segment or no input at all cannot).
CASES = [(m, p, mode) for m, p in OPERATIONS
         for mode in (GenerationMode.POSITIVE, *([GenerationMode.NEGATIVE] if m == "POST" else []))]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_generated_requests_never_answer_5xx(client, schema, method, path, mode):
    operation = schema[path][method]
    failures = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = send(client, case)
        SENT[f"{method} {path}", mode.value, response.status_code // 100] += 1
        if response.status_code >= 500:
            failures.append((response.status_code, case.body, case.query, response.text[:300]))
            return
        if response.status_code >= 400:
            api_shaped_error(path, response)
        case.validate_response(response, checks=[status_code_conformance, content_type_conformance])

    fuzz()
    counts = ", ".join(f"{n} x {k}xx" for (op, m, k), n in sorted(SENT.items()) if (op, m) == (f"{method} {path}", mode.value))
    print(f"\nfuzzed {method} {path} ({mode.value}): {counts}")
    assert not failures, f"{len(failures)} 5xx, e.g. {failures[:3]}"


def test_healthy_after_the_fuzz(client):
    assert client.get("/health").status_code == 200
    answer = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert answer.status_code == 200, answer.text
    by_class = Counter()
    for (_, _, k), n in SENT.items():
        by_class[k] += n
    print(f"\nfuzz total: {sum(SENT.values())} requests: " + ", ".join(f"{n} x {k}xx" for k, n in sorted(by_class.items())))
