"""Faults of the engine itself: when its thread dies, waiting and later requests fail at once and /health says
503; while it works through requests, /health answers without queueing a probe behind them."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app


def test_a_dead_engine_thread_fails_requests_fast_and_health_says_so(embedded, monkeypatch):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048))
    with TestClient(create_app(AsyncEngine(engine)), raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200

        def die():
            raise KeyboardInterrupt("injected: the engine thread dies")  # not an Exception: escapes the step

        monkeypatch.setattr(engine, "step", die)
        started = time.monotonic()
        first = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
        assert first.status_code >= 400 and "engine stopped" in first.text
        health = client.get("/health")
        assert health.status_code == 503 and "engine stopped" in health.json()["error"]
        later = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert later.status_code >= 400
        assert time.monotonic() - started < 30  # nothing waited on a queue nobody fills


def test_health_does_not_queue_behind_a_busy_engine(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    async_engine = AsyncEngine(engine)
    with TestClient(create_app(async_engine)) as client:
        long = {"inputs": "Count:", "parameters": {"max_new_tokens": 200, "ignore_eos_token": True}}
        worker = threading.Thread(target=lambda: client.post("/generate", json=long))
        worker.start()
        deadline = time.monotonic() + 60
        while async_engine.last_step_at is None and time.monotonic() < deadline:  # the long request is stepping
            time.sleep(0.01)
        added = []
        original = engine.add_request
        engine.add_request = lambda *a, **k: added.append(a) or original(*a, **k)
        try:
            assert client.get("/health").status_code == 200
            assert added == []  # answered from the engine's recent steps, not by a probe queued behind the work
        finally:
            engine.add_request = original
        worker.join(timeout=300)
