"""Request bodies are capped before parsing (413, --max-request-bytes), and tokenization runs off the event loop
(a long prompt never stops the server answering others)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

CAP = 4096


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(max_request_bytes=CAP))) as c:
        yield c


def test_bodies_over_the_cap_are_413_in_each_apis_shape(client):
    big = "x" * (CAP + 1)
    native = client.post("/generate", json={"inputs": big})
    assert native.status_code == 413 and native.json()["error_type"] == "payload_too_large"
    openai = client.post("/v1/completions", json={"prompt": big})
    assert openai.status_code == 413 and openai.json()["error"]["code"] == "payload_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b"x" * (CAP // 2)

    chunked = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    ok = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_tokenization_runs_off_the_event_loop(client, monkeypatch):
    tokenizer = client.app.state.loraplex.tokenizer
    threads = []
    encode = type(tokenizer).encode

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "encode", recording)
    loop_thread = client.portal.call(threading.current_thread)  # the thread the app's event loop runs on
    assert client.post("/tokenize", json={"inputs": "Hello there"}).status_code == 200
    assert client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 1}}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1}).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 1}).status_code == 200
    assert len(threads) >= 4 and loop_thread not in threads
