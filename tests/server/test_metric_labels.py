"""Metrics under the peers' names and labels (issue 59): every vLLM-named series carries vLLM's `model_name` label
(the served model name), and LoRAX's `lorax_request_validation_duration` is observed for each request queued."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(served_model_name=("served-name",)))) as c:
        yield c


def families(client) -> dict:
    return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}


def test_every_vllm_series_carries_the_served_model_name(client):
    assert client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    vllm = {name: f for name, f in families(client).items() if name.startswith("vllm:")}
    for expected in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries", "vllm:num_preemptions", "vllm:lora_requests_info",
                     "vllm:time_to_first_token_seconds", "vllm:request_success"):
        assert expected in vllm, expected
    for name, family in vllm.items():
        assert family.samples, name
        assert all(sample.labels.get("model_name") == "served-name" for sample in family.samples), name


def test_the_validation_duration_is_observed_once_per_request(client):
    def count() -> float:
        family = families(client).get("lorax_request_validation_duration")
        assert family is not None
        return next(s.value for s in family.samples if s.name.endswith("_count"))

    before = count()
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2}).status_code == 200
    assert client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    assert count() == before + 2  # n=2 is one request: validated once
