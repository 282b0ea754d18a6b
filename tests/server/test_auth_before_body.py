"""Issue 58, item 4: with --api-key the key is checked on a request's headers before a byte of its body is read. An
unauthenticated POST is answered 401 at once whatever its body declares (not 413 for a large one, no wait for one
that never comes), with the CORS headers as before; a body that stops arriving is answered 408 after
BODY_READ_TIMEOUT_S, in the route's API shape, while one that keeps coming, however slowly, is not cut."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server import disconnects
from loraplex.server.app import create_app
from tests.helpers import live_server

KEY = "key-one"
ORIGIN = "https://app.example"
HUGE = 40 * 1024 * 1024  # over the default --max-request-bytes (32 MiB)


@pytest.fixture(scope="module")
def app(embedded):
    """The app itself, called without its lifespan: nothing here reaches the engine."""
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048)))
    yield create_app(engine, ServerConfig(api_keys=(KEY,), cors_allow_origin=(ORIGIN,)))
    engine.shutdown()


class Client:
    """One ASGI request whose body is `chunks`, then (stall) a client that sends nothing more and stays."""

    def __init__(self, chunks: list[bytes], stall: bool, delay: float = 0.0) -> None:
        self.pending, self.stall, self.delay = list(chunks), stall, delay
        self.receives = self.consumed = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.receives += 1
        if self.pending:
            await asyncio.sleep(self.delay)
            chunk = self.pending.pop(0)
            self.consumed += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.pending) or self.stall}
        await asyncio.Event().wait()  # never: the client neither sends nor leaves
        raise AssertionError

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def headers(self) -> dict[str, str]:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    def json(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"))


def call(app, method: str, path: str, headers: dict[str, str], client: Client, limit: float = 5.0) -> Client:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    # Bounded: before the change the app waits for the rest of the body forever.
    asyncio.run(asyncio.wait_for(app(scope, client.receive, client.send), limit))
    return client


@pytest.mark.parametrize("declared", [HUGE, 1000])
def test_an_unauthenticated_post_is_401_before_its_body_is_read(app, declared):
    for path in ("/generate", "/v1/chat/completions"):
        client = call(app, "POST", path, {"content-type": "application/json", "content-length": str(declared)},
                      Client([b'{"inputs":'], stall=True))
        assert client.status == 401, (path, client.sent)
        assert client.receives == 0 and client.consumed == 0  # not one byte of the body was asked for
        assert client.headers["www-authenticate"] == "Bearer"
        if path.startswith("/v1/"):
            assert client.json()["error"]["type"] == "authentication_error"
        else:
            assert client.json()["error_type"] == "unauthorized"


def test_cors_preflights_and_the_401s_cors_headers_are_kept(app):
    preflight = call(app, "OPTIONS", "/v1/completions", {
        "origin": ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"}, Client([], stall=False))
    assert preflight.status == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    refused = call(app, "POST", "/v1/completions", {"origin": ORIGIN, "content-length": str(HUGE)},
                   Client([b"x" * 10], stall=True))
    assert refused.status == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    assert refused.consumed == 0


def test_a_body_that_stops_arriving_is_408(app, monkeypatch):
    monkeypatch.setattr(disconnects, "BODY_READ_TIMEOUT_S", 0.3)
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json", "content-length": "1000"}
    for path in ("/generate", "/v1/completions"):
        started = time.monotonic()
        client = call(app, "POST", path, auth, Client([b"x" * 10], stall=True))
        took = time.monotonic() - started
        assert client.status == 408, (path, client.sent)
        assert 0.3 <= took < 3, took
        assert client.headers["connection"] == "close"  # the rest of that body is not waited for
        if path.startswith("/v1/"):
            error = client.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "body_timeout")
        else:
            assert client.json()["error_type"] == "body_timeout"
    # Headers and then nothing at all: the first read is timed too.
    assert call(app, "POST", "/generate", auth, Client([], stall=True)).status == 408


def test_a_slow_body_that_keeps_coming_is_not_cut(app, monkeypatch):
    monkeypatch.setattr(disconnects, "BODY_READ_TIMEOUT_S", 0.3)
    # Eight parts 0.1 s apart: the whole body takes longer than the timeout, no pause reaches it. The path is
    # unknown, so that its 404 (answered once the body is read) needs no running engine.
    client = call(app, "POST", "/no-such-route", {"authorization": f"Bearer {KEY}", "content-length": "80"},
                  Client([b"x" * 10] * 8, stall=False, delay=0.1))
    assert client.status == 404 and client.consumed == 80


@pytest.fixture(scope="module")
def server():
    with live_server("--api-key", KEY, "--max-batch-total-tokens", "2048") as url:
        yield url


def raw_request(server: str, head: str, first_bytes: bytes) -> tuple[str, float]:
    """Sends a request's head and the first bytes of its body, and no more; the status line that comes back and
    the seconds it took."""
    url = urlparse(server)
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        started = time.monotonic()
        conn.sendall(head.encode() + b"\r\n" + first_bytes)
        try:
            answer = conn.recv(65536).decode("latin-1")
        except socket.timeout:
            answer = "(no answer in 10 s)"
        return answer.split("\r\n", 1)[0], time.monotonic() - started


def test_a_live_server_answers_401_before_the_body_is_sent(server):
    head = "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for framing in (f"Content-Length: {HUGE}\r\n", "Content-Length: 1000\r\n", "Transfer-Encoding: chunked\r\n"):
        first = b"a\r\n0123456789\r\n" if "chunked" in framing else b"0123456789"
        status, took = raw_request(server, head + framing, first)
        print(f"{framing.strip()}: {status} in {took * 1000:.0f} ms")
        assert status == "HTTP/1.1 401 Unauthorized", (framing, status)
        assert took < 2, took  # at once (well under a second unless the machine is very busy)
    # The same server with the key: the body is read and the request served.
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    ok = httpx.post(f"{server}/generate", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200, ok.text
