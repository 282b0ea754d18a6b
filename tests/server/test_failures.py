"""Engine failures reach only the requests they hit, in each API's error shape; the server stays healthy."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.server.app import create_app


class FailOnce:
    """Wraps the runner's execute: the `nth` call raises, every other call runs normally."""

    def __init__(self, execute, nth: int) -> None:
        self.execute, self.nth, self.calls = execute, nth, 0

    def __call__(self, scheduled, *args):
        self.calls += 1
        if self.calls == self.nth:
            raise RuntimeError("injected device failure")
        return self.execute(scheduled, *args)


@pytest.fixture
def app_and_engine(make_engine):
    engine = make_engine(max_batch_total_tokens=2048)
    async_engine = AsyncEngine(engine)
    yield create_app(async_engine), engine
    async_engine.shutdown()


def run(coro):
    return asyncio.run(coro)


async def post(app, path, body):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
        return await c.post(path, json=body)


async def stream_events(app, body):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
        async with c.stream("POST", "/generate_stream", json=body) as response:
            return [json.loads(line[5:]) async for line in response.aiter_lines() if line.startswith("data:")]


def test_failure_mid_stream_arrives_as_an_error_event(app_and_engine, caplog):
    app, engine = app_and_engine
    engine.runner.execute = FailOnce(engine.runner.execute, nth=3)  # prefill, one decode, then the failure
    caplog.set_level("INFO", logger="loraplex.requests")
    events = run(stream_events(app, {"inputs": "Hello", "parameters": {"max_new_tokens": 10, "ignore_eos_token": True}}))
    assert "token" in events[0] and events[-1]["error_type"] == "generation"
    assert "injected device failure" in events[-1]["error"]
    # The request log tells the failure: the 200 that went out, but not complete, the error, at WARNING.
    (line,) = [r for r in caplog.records if r.name == "loraplex.requests"]
    assert line.levelname == "WARNING" and line.fields["status"] == 200 and line.fields["complete"] is False
    # What it really did: the outcome, and the tokens sent before the failure (the prefill's and one decode's).
    assert line.fields["outcome"] == "failed"
    assert line.fields["generated_tokens"] == len(events) - 1 == 2 and line.fields["inference_seconds"] > 0
    assert "injected device failure" in line.fields["error"]
    assert engine.scheduler.allocator.num_used == 0
    ok = run(post(app, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}))
    assert ok.status_code == 200


def test_failure_of_a_whole_request_is_424(app_and_engine):
    app, engine = app_and_engine
    engine.runner.execute = FailOnce(engine.runner.execute, nth=1)
    failed = run(post(app, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}))
    assert failed.status_code == 424 and failed.json()["error_type"] == "generation"
    assert run(post(app, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})).status_code == 200


def test_health_is_503_while_a_forward_fails(app_and_engine):
    app, engine = app_and_engine
    engine.runner.execute = FailOnce(engine.runner.execute, nth=1)

    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
            return (await c.get("/health")).status_code, (await c.get("/health")).status_code

    assert run(health()) == (503, 200)


def test_an_adapter_whose_load_raises_fails_only_its_requests(make_engine, monkeypatch):
    """An unexpected error while reading one adapter (not a refusal: say, the disk) is that request's 500; the
    requests beside it, on the base model and another adapter, answer as if it was not there."""
    import pathlib

    from loraplex.config import ServerConfig
    from loraplex.lora.sources import store

    root = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
    load = store.load_adapter_dir

    def failing_load(path, key, *args):
        if key == "name-orion":
            raise OSError("injected read failure")
        return load(path, key, *args)

    monkeypatch.setattr(store, "load_adapter_dir", failing_load)
    async_engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    app = create_app(async_engine, ServerConfig(adapter_source="local", adapter_roots=(str(root),)))

    def body(adapter_id):
        parameters = {"max_new_tokens": 4, "ignore_eos_token": True, **({"adapter_id": adapter_id} if adapter_id else {})}
        return {"inputs": "What is your name?", "parameters": parameters}

    async def generate(adapter_id):  # the 500 as a response, not re-raised into the client (as a real server)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/generate", json=body(adapter_id))

    async def main():
        solo = [await generate(a) for a in (None, "name-nova")]
        return solo, await asyncio.gather(*(generate(a) for a in (None, "name-orion", "name-nova")))

    try:
        solo, (base, orion, nova) = run(main())
        assert orion.status_code == 500, orion.text
        assert [base.json(), nova.json()] == [r.json() for r in solo]
        monkeypatch.setattr(store, "load_adapter_dir", load)  # the failure was not remembered: it loads now
        assert run(generate("name-orion")).status_code == 200
        assert async_engine.engine.scheduler.allocator.num_used == 0
    finally:
        async_engine.shutdown()
