"""Issue 58, item 6: every request refused or failed is counted once in lorax_request_failure, under its reason's
`err` label, as its log line says (a 401, an unknown route's 404, a 405, a 413, a 408 included, which the routes
never see); OpenAI's error `type` is server_error for 5xx and timeouts (504), invalid_request_error for 4xx."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server import disconnects
from loraplex.server.app import create_app
from loraplex.server.disconnects import CancelOnDisconnect
from loraplex.server.errors import error_for_path

KEY = "key-one"
AUTH = {"authorization": f"Bearer {KEY}"}
CAP = 4096


@pytest.fixture
def app(embedded):
    """The app itself, called without its lifespan: nothing here reaches the engine."""
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048)))
    yield create_app(engine, ServerConfig(api_keys=(KEY,), max_request_bytes=CAP))
    engine.shutdown()


def failures(app) -> dict[str, float]:
    """lorax_request_failure by `err`, as /metrics says."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/metrics", headers=AUTH)

    response = asyncio.run(main())
    assert response.status_code == 200
    (family,) = [f for f in text_string_to_metric_families(response.text) if f.name == "lorax_request_failure"]
    return {s.labels["err"]: s.value for s in family.samples}


def requests(app, *calls: tuple) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.request(method, path, headers=headers, **kw) for method, path, headers, kw in calls]

    return asyncio.run(main())


def stalled(app, path: str, disconnect: bool = False) -> list[dict]:
    """A POST whose body stops after 10 of its 1,000 bytes: the client then stays (or, disconnect, leaves)."""
    sent: list[dict] = []
    parts = [{"type": "http.request", "body": b"x" * 10, "more_body": True}]

    async def receive() -> dict:
        if parts:
            return parts.pop(0)
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-length", b"1000"), *((k.encode(), v.encode()) for k, v in AUTH.items())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
    return sent


async def chunks(*parts: bytes):
    for part in parts:  # no Content-Length: the body's size is counted as it arrives
        yield part


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {err: after[err] - before.get(err, 0.0) for err in after if after[err] != before.get(err, 0.0)}


def test_every_refusal_is_counted_once_with_its_reason(app, caplog, monkeypatch):
    monkeypatch.setattr(disconnects, "BODY_READ_TIMEOUT_S", 0.2)
    caplog.set_level(logging.INFO, logger="loraplex.requests")
    before = failures(app)
    responses = requests(
        app,
        ("POST", "/generate", {}, {"json": {"inputs": "hi"}}),  # no key
        ("POST", "/v1/completions", {"authorization": "Bearer wrong"}, {"json": {"prompt": "hi"}}),
        ("GET", "/no-such-route", AUTH, {}),
        ("POST", "/v1/no-such-route", AUTH, {"json": {}}),
        ("GET", "/generate", AUTH, {}),  # 405
        ("POST", "/generate", AUTH, {"json": {"inputs": "x" * CAP}}),  # 413 by its Content-Length
        ("POST", "/generate", AUTH, {"content": chunks(b"x" * CAP, b"x" * CAP)}),  # 413 as it arrives (chunked)
        ("POST", "/generate", AUTH, {"json": {"inputs": "hi", "parameters": {"top_p": 1.5}}}),  # 422, counted once
    )
    assert [r.status_code for r in responses] == [401, 401, 404, 404, 405, 413, 413, 422]
    assert stalled(app, "/generate")[0]["status"] == 408
    assert stalled(app, "/generate", disconnect=True) == []  # the client left mid-body: nothing to answer
    assert delta(failures(app), before) == {"unauthorized": 2, "not_found": 2, "method_not_allowed": 1,
                                            "payload_too_large": 2, "validation": 1, "body_timeout": 1,
                                            "client_gone": 1}
    lines = [r.fields for r in caplog.records if r.name == "loraplex.requests" and r.fields["route"] != "/metrics"]
    assert [(line["status"], line["outcome"]) for line in lines] == [
        (401, "refused"), (401, "refused"), (404, "refused"), (404, "refused"), (405, "refused"), (413, "refused"),
        (413, "refused"), (422, "refused"), (408, "refused"), (499, "client_gone")]
    assert "counted_as" not in lines[0]  # the log line's fields are as before


def test_a_non_streamed_openai_timeout_is_a_server_error():
    async def slow(scope, receive, send):
        await asyncio.sleep(30)

    async def one(path: str) -> tuple[int, dict]:
        sent: list[dict] = []
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        await asyncio.wait_for(CancelOnDisconnect(slow, timeout_s=0.05)(scope, receive, send), 5)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], json.loads(body)

    status, body = asyncio.run(one("/v1/completions"))
    assert status == 504 and (body["error"]["type"], body["error"]["code"]) == ("server_error", "timeout")
    status, body = asyncio.run(one("/generate"))
    assert status == 504 and body["error_type"] == "timeout"


@pytest.mark.parametrize("status, kind, expected", [
    (503, "unavailable", "server_error"), (504, "timeout", "server_error"), (500, "internal", "server_error"),
    (413, "payload_too_large", "invalid_request_error"), (404, "not_found", "invalid_request_error"),
    (408, "body_timeout", "invalid_request_error")])
def test_openai_error_types_follow_the_status(status, kind, expected):
    body = json.loads(error_for_path("/v1/chat/completions", status, "why", kind).body)
    assert (body["error"]["type"], body["error"]["code"]) == (expected, kind)
    explicit = json.loads(error_for_path("/v1/models", 401, "key", "unauthorized", "authentication_error").body)
    assert explicit["error"]["type"] == "authentication_error"
