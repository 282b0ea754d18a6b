"""--api-key: every route but the health routes needs a key, in each API's error shape; the OpenAI client's api_key
works; with --cors-allow-origin a browser's preflight passes without one and a 401 carries the CORS headers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

KEYS = ("key-one", "key-two")


ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def engine(embedded):
    return Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(api_keys=KEYS))) as c:
        yield c


@pytest.fixture(scope="module")
def cors_client(engine):
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(api_keys=KEYS, cors_allow_origin=(ORIGIN,)))) as c:
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
    for path in ("/health", "/ping"):  # load balancers' and SageMaker's probes, GET or HEAD
        assert client.get(path).status_code == 200, path
        assert client.head(path).status_code == 200, path
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


def test_a_browser_preflight_needs_no_key_and_a_401_carries_cors_headers(cors_client):
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    response = cors_client.options("/v1/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    refused = cors_client.get("/info", headers={"origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    allowed = cors_client.get("/info", headers={"origin": ORIGIN, "authorization": f"Bearer {KEYS[0]}"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN


def test_options_is_never_refused_for_want_of_a_key(client):
    assert client.options("/generate").status_code != 401
