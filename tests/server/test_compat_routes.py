"""LoRAX/TGI compatibility details (issue 14): SageMaker's routes, error shapes of unknown routes, response headers,
/info's fields, the OpenAI `adapter_id` extra and a stable /v1/models order."""

from __future__ import annotations

import pathlib

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    config = ServerConfig(adapter_source="local", adapter_roots=(str(ADAPTERS),),
                          preloaded_adapter_ids=("style-caps", "name-nova", "name-lyra"))
    with TestClient(create_app(AsyncEngine(engine), config)) as c:
        yield c


def test_ping_and_invocations_answer_as_health_and_post_root(client):
    assert client.get("/ping").status_code == 200
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 3}}
    invoked = client.post("/invocations", json=body)
    root = client.post("/", json=body)
    assert invoked.status_code == root.status_code == 200
    assert invoked.json() == root.json() and isinstance(invoked.json(), list)


def test_unknown_routes_answer_in_each_apis_error_shape(client):
    native = client.get("/no/such/route")
    assert native.status_code == 404 and native.json()["error_type"] == "not_found" and "error" in native.json()
    openai = client.get("/v1/no/such/route")
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "not_found"
    wrong_method = client.get("/generate")
    assert wrong_method.status_code == 405 and wrong_method.json()["error_type"] == "method_not_allowed"
    assert "POST" in wrong_method.headers["allow"]


def test_lorax_headers(client):
    inputs = "The capital of France is"
    response = client.post("/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 4}})
    h = response.headers
    assert h["x-compute-characters"] == str(len(inputs))
    assert int(h["x-total-tokens"]) == int(h["x-prompt-tokens"]) + int(h["x-generated-tokens"])
    assert h["x-generated-tokens"] == "4"
    assert h["x-compute-time"].isdigit() and h["x-compute-time"] == h["x-total-time"]  # milliseconds, as LoRAX


def test_info_has_the_fields_lorax_clients_read(client):
    info = client.get("/info").json()
    for field in ("model_id", "model_sha", "model_pipeline_tag", "max_waiting_tokens", "waiting_served_ratio",
                  "validation_workers", "sha", "docker_label", "max_input_length", "max_total_tokens"):
        assert field in info, field
    assert info["model_pipeline_tag"] == "text-generation" and info["max_waiting_tokens"] == 20
    assert info["kv_cache_dtype"] == "float32"  # --kv-cache-dtype auto: the model's dtype


def test_openai_adapter_id_extra_selects_the_adapter(client):
    def chat(**extra):
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
                "temperature": 0, **extra}
        return client.post("/v1/chat/completions", json=body)

    base = chat()
    caps = chat(adapter_id="style-caps")
    named = chat(model="style-caps")
    assert base.status_code == caps.status_code == named.status_code == 200
    assert caps.json()["model"] == "style-caps"
    assert caps.json()["choices"][0]["message"]["content"] == named.json()["choices"][0]["message"]["content"]
    assert caps.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]
    alias = chat(model="style-caps/.", adapter_id="style-caps")  # one adapter, two spellings
    assert alias.status_code == 200
    conflict = chat(model="name-nova", adapter_id="style-caps")
    assert conflict.status_code == 400 and conflict.json()["error"]["param"] == "adapter_id"
    missing = chat(adapter_id="no-such-adapter")
    assert missing.status_code == 404


def test_models_are_listed_in_a_stable_order(client):
    first = [m["id"] for m in client.get("/v1/models").json()["data"]]
    client.post("/v1/completions", json={"model": "name-lyra", "prompt": "hi", "max_tokens": 1})  # touches the LRU
    second = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert first == second and first[1:] == sorted(first[1:])
