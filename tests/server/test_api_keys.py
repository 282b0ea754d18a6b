"""--api-key: every route but /health needs a key, in each API's error shape; the OpenAI client's api_key works."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(api_keys=KEYS))) as c:
        yield c


ROUTES = [("get", "/info"), ("get", "/metrics"), ("get", "/v1/models"), ("get", "/docs"), ("get", "/playground"),
          ("post", "/generate"), ("post", "/tokenize"), ("post", "/v1/completions"), ("get", "/openapi.json")]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_but_health_needs_a_key(client, method, path):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic key-one"},
                    {"authorization": "key-one"}):
        response = getattr(client, method)(path, headers=headers)
        assert response.status_code == 401, (path, headers)
        assert response.headers["www-authenticate"] == "Bearer"
        if path.startswith("/v1/"):
            assert response.json()["error"]["code"] == "invalid_api_key"
        else:
            assert response.json()["error_type"] == "unauthorized"


def test_any_of_the_keys_opens_and_health_is_open(client):
    assert client.get("/health").status_code == 200
    for key in KEYS:
        assert client.get("/info", headers={"authorization": f"Bearer {key}"}).status_code == 200
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    assert client.post("/generate", json=body, headers={"authorization": "bearer key-two"}).status_code == 200


def test_the_openai_client_sends_its_api_key(client):
    import openai

    # Not closed: they share the test's client, which the fixture closes.
    ok = openai.OpenAI(base_url="http://testserver/v1", api_key="key-one", http_client=client)
    assert ok.models.list().data
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=client, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
