"""One log line per HTTP request on `loraplex.requests`: for answers, refusals before the route runs, unknown
adapters, server errors and streams (written when the stream ends or is cut, not when its headers go out);
key=value text by default, one JSON object per line once JSON logging is configured."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import pathlib

import httpx
import pytest

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.server.app import create_app
from loraplex.server.logs import configure_json_logging
from loraplex.server.request_log import key_values

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
FIELDS = ("request_id", "method", "route", "adapter", "status", "prompt_tokens", "generated_tokens",
          "queue_seconds", "inference_seconds", "total_seconds", "complete", "error", "outcome")


@pytest.fixture
def app(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    yield create_app(engine, ServerConfig(adapter_source="local", adapter_roots=(str(ADAPTERS),)))
    engine.shutdown()


@pytest.fixture
def lines(caplog):
    """The request log's records so far, as their fields."""
    caplog.set_level(logging.INFO, logger="loraplex.requests")
    return lambda: [r.fields for r in caplog.records if r.name == "loraplex.requests"]


def call(app, method: str, path: str, body: dict | None = None, **client) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app, **client)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await c.request(method, path, json=body)

    return asyncio.run(main())


def generate(max_new_tokens: int, **parameters) -> dict:
    return {"inputs": "Hello there", "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True,
                                                     **parameters}}


def test_an_answer_is_one_line_with_the_requests_numbers(app, lines, caplog):
    response = call(app, "POST", "/generate", generate(3, adapter_id="name-nova"))
    assert response.status_code == 200
    (line,) = lines()
    assert tuple(line) == FIELDS
    assert line["request_id"] == response.headers["x-request-id"]
    assert (line["method"], line["route"], line["adapter"], line["status"]) == ("POST", "/generate", "name-nova", 200)
    assert line["prompt_tokens"] == int(response.headers["x-prompt-tokens"]) > 0
    assert line["generated_tokens"] == 3 and line["complete"] is True
    assert 0 <= line["queue_seconds"] and 0 < line["inference_seconds"] <= line["total_seconds"]
    text = next(r.getMessage() for r in caplog.records if r.name == "loraplex.requests")
    assert text.startswith(f"request_id={line['request_id']} method=POST route=/generate adapter=name-nova status=200 ")


def test_the_clients_request_id_is_kept(app, lines):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/info", headers={"x-request-id": "abc-123"})

    assert asyncio.run(main()).headers["x-request-id"] == "abc-123"
    assert lines()[0]["request_id"] == "abc-123"


def test_refusals_before_the_route_runs_are_logged(app, lines):
    native = call(app, "POST", "/generate", {"inputs": "hi", "parameters": {"top_p": 1.5}})
    openai = call(app, "POST", "/v1/completions", {"model": "", "prompt": "hi", "temperature": "hot"})
    nowhere = call(app, "GET", "/no/such/path")
    assert (native.status_code, openai.status_code, nowhere.status_code) == (422, 400, 404)
    got = [(line["route"], line["status"], line["prompt_tokens"], line["generated_tokens"]) for line in lines()]
    assert got == [("/generate", 422, 0, 0), ("/v1/completions", 400, 0, 0), ("/no/such/path", 404, 0, 0)]


def test_an_unknown_adapter_is_logged_with_the_name_asked_for(app, lines):
    native = call(app, "POST", "/generate", generate(2, adapter_id="no-such-adapter"))
    chat = {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]}
    openai = call(app, "POST", "/v1/chat/completions", chat)
    # 404, or 503 where this machine cannot reach the hub (the adapter's default source) to ask
    status = native.status_code
    assert openai.status_code == status in (404, 503)
    assert [(line["adapter"], line["status"]) for line in lines()] == [("no-such-adapter", status)] * 2


def test_a_server_error_is_logged_as_500(app, lines, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("tokenizer broke")

    monkeypatch.setattr(app.state.loraplex.tokenizer, "encode", broken)
    response = call(app, "POST", "/tokenize", {"inputs": "hi"}, raise_app_exceptions=False)
    assert response.status_code == 500
    assert [(line["route"], line["status"], line["complete"]) for line in lines()] == [("/tokenize", 500, False)]


async def drive(app, lines, body: dict, cut_after_chunks: int | None = None) -> tuple[int, list[bytes], int]:
    """POST /generate_stream through the ASGI app by hand. Returns the status, the body chunks, and how many
    request log lines there were when the headers went out; with `cut_after_chunks` the client goes away then."""
    chunks: list[bytes] = []
    gone, asked, seen = asyncio.Event(), [False], {}

    async def receive():
        if not asked[0]:
            asked[0] = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            seen["status"], seen["lines_at_headers"] = message["status"], len(lines())
        elif message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == cut_after_chunks:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/generate_stream", "raw_path": b"/generate_stream", "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    await app(scope, receive, send)
    return seen["status"], chunks, seen["lines_at_headers"]


def test_a_stream_is_logged_when_it_ends_not_when_headers_go_out(app, lines):
    status, chunks, at_headers = asyncio.run(drive(app, lines, generate(4)))
    assert status == 200 and len(chunks) == 4 and at_headers == 0
    (line,) = lines()
    assert (line["route"], line["status"], line["generated_tokens"]) == ("/generate_stream", 200, 4)
    assert line["complete"] is True
    assert line["prompt_tokens"] > 0 and line["inference_seconds"] > 0


def test_a_stream_cut_by_the_client_is_logged_once_as_incomplete(app, lines):
    status, chunks, at_headers = asyncio.run(drive(app, lines, generate(500), cut_after_chunks=1))
    assert status == 200 and at_headers == 0 and len(chunks) < 500
    (line,) = lines()
    assert (line["status"], line["complete"], line["outcome"]) == (200, False, "client_gone")
    assert 1 <= line["generated_tokens"] < 500  # the tokens it made before the cut, not 0
    assert line["prompt_tokens"] > 0


@pytest.fixture
def json_stderr():
    """JSON logging configured onto a buffer (standing in for stderr); the root logger restored after."""
    root = logging.getLogger()
    handlers, level, buffer = root.handlers[:], root.level, io.StringIO()
    configure_json_logging(buffer)
    yield buffer
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_logging_writes_one_object_per_line(app, json_stderr):
    assert call(app, "POST", "/generate", generate(2)).status_code == 200
    assert call(app, "POST", "/generate", {"inputs": "hi", "parameters": {"top_p": 1.5}}).status_code == 422
    logging.getLogger("loraplex.other").warning("a plain message\nover two lines")
    objects = [json.loads(line) for line in json_stderr.getvalue().splitlines()]  # every line is JSON
    requests = [o for o in objects if o["target"] == "loraplex.requests"]
    assert [(o["route"], o["status"], o["level"]) for o in requests] == [("/generate", 200, "INFO"),
                                                                          ("/generate", 422, "INFO")]
    assert requests[0]["generated_tokens"] == 2 and set(FIELDS) <= set(requests[0])
    assert {"message": "a plain message\nover two lines", "target": "loraplex.other"}.items() <= objects[-1].items()


def test_client_given_values_cannot_break_a_text_line():
    text = key_values({"adapter": 'a b"=c\nd', "none": None, "dash": "-", "ok": "name-nova"})
    assert text == 'adapter="a b\\"=c\\nd" none=- dash="-" ok=name-nova'
