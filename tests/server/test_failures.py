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


def test_failure_mid_stream_arrives_as_an_error_event(app_and_engine):
    app, engine = app_and_engine
    engine.runner.execute = FailOnce(engine.runner.execute, nth=3)  # prefill, one decode, then the failure
    events = run(stream_events(app, {"inputs": "Hello", "parameters": {"max_new_tokens": 10, "ignore_eos_token": True}}))
    assert "token" in events[0] and events[-1]["error_type"] == "generation"
    assert "injected device failure" in events[-1]["error"]
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
