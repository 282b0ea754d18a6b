"""A client that goes away stops its request, streamed or not, on every generation route: the running gauge and
the KV cache go back to idle within a few steps; `--request-timeout-s` aborts an overrunning request with a 504, or
ends its stream with an error event in its API's shape, counted as a timeout."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.helpers import live_server

LONG = 3000  # tokens a request would generate if nobody stopped it (minutes on this CPU)
ROUTES = {
    "generate": ("/generate", {"inputs": "Count:", "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True}}),
    "generate_stream": ("/generate_stream",
                        {"inputs": "Count:", "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True}}),
    "root": ("/", {"inputs": "Count:", "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True}}),
    "completions": ("/v1/completions", {"prompt": "Count:", "max_tokens": LONG, "ignore_eos": True}),
    "completions_stream": ("/v1/completions", {"prompt": "Count:", "max_tokens": LONG, "ignore_eos": True,
                                               "stream": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}], "max_tokens": LONG,
                                      "ignore_eos": True}),
    "chat_stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}], "max_tokens": LONG,
                                             "ignore_eos": True, "stream": True}),
}


@pytest.fixture(scope="module")
def server():
    with live_server("--max-batch-total-tokens", "8192", "--max-total-tokens", "4096") as url:
        yield url


def gauges(server: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", 'lorax_request_failure{err="client_gone"}'):
            if line.startswith(name):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def wait_for(server: str, running: int, timeout: float) -> float:
    """Seconds until the running gauge reads `running` (and, at 0, the KV cache is empty)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        g = gauges(server)
        if g["vllm:num_requests_running"] == running and (running or g["vllm:kv_cache_usage_perc"] == 0):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"running never reached {running} in {timeout} s: {gauges(server)}")


def wait_for_more_kv(server: str, usage: float, timeout: float) -> None:
    """Until the KV cache holds more than `usage` (the running request has filled another block)."""
    started = time.monotonic()
    while gauges(server)["vllm:kv_cache_usage_perc"] <= usage:
        assert time.monotonic() - started < timeout, f"the request made no progress in {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("route", ROUTES)
def test_a_client_that_leaves_stops_its_request(server, route):
    path, body = ROUTES[route]
    url = urlparse(server)
    payload = json.dumps(body).encode()
    gone_before = gauges(server).get('lorax_request_failure{err="client_gone"}', 0.0)
    with socket.create_connection((url.hostname, url.port)) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for(server, running=1, timeout=60)
        wait_for_more_kv(server, gauges(server)["vllm:kv_cache_usage_perc"], timeout=60)  # a block of tokens in
    # Within a few steps (a busy shared machine gets slack; the request would otherwise run for minutes).
    released = wait_for(server, running=0, timeout=30)
    print(f"{route}: running gauge and KV cache back to idle {released:.2f} s after the client left")
    assert gauges(server)['lorax_request_failure{err="client_gone"}'] == gone_before + 1  # counted as what it was
    ok = httpx.post(f"{server}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200  # and its concurrency slot came back


def test_request_timeout_aborts_with_504():
    with live_server("--max-batch-total-tokens", "8192", "--request-timeout-s", "1") as server:
        native = httpx.post(f"{server}/generate", json=ROUTES["generate"][1], timeout=60)
        assert native.status_code == 504 and native.json()["error_type"] == "timeout"
        openai = httpx.post(f"{server}/v1/completions", json=ROUTES["completions"][1], timeout=60)
        assert openai.status_code == 504 and openai.json()["error"]["code"] == "timeout"
        for route, last in (("generate_stream", -1), ("completions_stream", -2), ("chat_stream", -2)):
            path, body = ROUTES[route]
            with httpx.stream("POST", f"{server}{path}", json=body, timeout=60) as response:
                assert response.status_code == 200
                events = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
            assert len(events) > 2, route  # tokens went out before the deadline
            error = json.loads(events[last])
            if route == "generate_stream":
                assert error == {"error": "the request took longer than 1 s (--request-timeout-s)",
                                 "error_type": "timeout"}
            else:
                assert events[-1] == "[DONE]" and error["error"]["code"] == "timeout", (route, events[-3:])
        timeouts = [line for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines()
                    if line.startswith("lorax_request_failure") and 'timed_out' in line]
        assert timeouts and float(timeouts[0].split()[-1]) == 5, timeouts  # two answered 504, three streams cut
        wait_for(server, running=0, timeout=10)
        quick = httpx.post(f"{server}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert quick.status_code == 200
