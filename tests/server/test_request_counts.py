"""Every list a request carries has a count limit checked right after parsing, before any work per element (issue
58): messages, content parts, tools, stop token ids (which must also be in the vocabulary); and what is checked per
element is linear (tool names)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.protocol.tools.definitions import ToolDefinition, plan_tools
from loraplex.server.app import create_app

LIMITS = dict(max_messages=8, max_content_parts=8, max_tools=4, max_stop_token_ids=4)


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(**LIMITS))) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                     **body})


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_each_list_over_its_limit_is_refused_naming_the_field_and_the_flag(client):
    messages = [{"role": "user", "content": "Hi"}] * 9
    refused = chat(client, messages=messages)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages" and "--max-messages" in refused.json()["error"]["message"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * 9}]
    assert chat(client, messages=parts).json()["error"]["param"] == "messages[].content"
    assert chat(client, tools=[tool(f"f{i}") for i in range(5)]).json()["error"]["param"] == "tools"
    assert chat(client, stop_token_ids=[1, 2, 3, 4, 5]).json()["error"]["param"] == "stop_token_ids"
    completion = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [1] * 5})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "stop_token_ids"
    native = client.post("/generate", json={"inputs": json.dumps(messages),
                                            "parameters": {"apply_chat_template": True, "max_new_tokens": 2}})
    assert native.status_code == 422 and "--max-messages" in native.json()["error"]
    # At the limit, each is served.
    assert chat(client, messages=[{"role": "user", "content": "Hi"}] * 8, tools=[tool(f"f{i}") for i in range(4)],
                stop_token_ids=[1, 2, 3, 4]).status_code == 200


def test_stop_token_ids_outside_the_vocabulary_are_refused(client):
    vocab = client.app.state.loraplex.tokenizer.vocab_size
    for ids in ([1_000_000_000], [-5], [vocab]):
        refused = chat(client, stop_token_ids=ids)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop_token_ids", ids
    assert chat(client, stop_token_ids=[vocab - 1]).status_code == 200


def test_a_request_of_many_messages_is_refused_while_others_are_answered(client):
    """200,000 messages (as a hostile client sends a million): refused after its parse, and /health answers within
    1.5 s meanwhile (the server used to render them all on the event loop's worker)."""
    body = {"messages": [{"role": "user", "content": "x"}] * 200_000, "max_tokens": 2}
    answer: dict = {}
    started = threading.Event()

    def send():
        started.set()
        answer["response"] = client.post("/v1/chat/completions", json=body)

    thread = threading.Thread(target=send)
    thread.start()
    assert started.wait(10)
    worst = 0.0
    while thread.is_alive():
        t = time.perf_counter()
        assert client.get("/health").status_code == 200
        worst = max(worst, time.perf_counter() - t)
    thread.join()
    assert answer["response"].status_code == 400 and answer["response"].json()["error"]["param"] == "messages"
    assert worst < 1.5, f"/health took {worst:.2f} s while the request was checked"


def test_duplicate_tool_names_are_found_in_linear_time():
    def tools(n: int, duplicate: bool) -> list[ToolDefinition]:
        names = [f"f{i}" for i in range(n)] + (["f0"] if duplicate else [])
        return [ToolDefinition.model_validate(tool(name)) for name in names]

    many = tools(40_000, duplicate=False)
    started = time.perf_counter()
    assert plan_tools(many, None, None).mode == "auto"
    assert time.perf_counter() - started < 1.0  # quadratic, it took minutes
    with pytest.raises(Exception, match="'f0' is given twice"):
        plan_tools(tools(1000, duplicate=True), None, None)


def test_a_body_of_the_wrong_shape_is_refused_as_before_not_counted_into_a_500(client):
    for body in ({"inputs": "x", "parameters": 5}, {"inputs": "x", "parameters": ["a"]}, ["not", "an", "object"]):
        answer = client.post("/generate", json=body)
        assert answer.status_code == 422, (body, answer.text)
    assert client.post("/v1/chat/completions", json={"messages": 5}).status_code == 400
