"""The real `loraplex serve` process on 127.0.0.1, driven over HTTP with httpx."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", "--hostname", "127.0.0.1", "--port", str(port),
         "--max-batch-total-tokens", "8192"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    ready = threading.Event()
    log: list[str] = []

    def drain() -> None:  # keep reading so the pipe never fills; flag the ready line
        for line in proc.stdout:
            log.append(line)
            if line.startswith("loraplex ready"):
                ready.set()
        ready.set()  # exited: let the fixture fail fast

    threading.Thread(target=drain, daemon=True).start()
    try:
        # The server binds its socket before printing the ready line.
        assert ready.wait(timeout=180) and proc.poll() is None, "server did not start:\n" + "".join(log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_generate_and_stream_agree(server):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 20, "details": True}}
    answer = httpx.post(f"{server}/generate", json=body, timeout=120)
    assert answer.status_code == 200
    data = answer.json()
    assert data["details"]["generated_tokens"] == len(data["details"]["tokens"]) > 0
    assert data["details"]["finish_reason"] in ("length", "eos_token")

    events = []
    with httpx.stream("POST", f"{server}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    assert all(e["generated_text"] is None for e in events[:-1])
    streamed = "".join(e["token"]["text"] for e in events)
    assert streamed == events[-1]["generated_text"] == data["generated_text"]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in data["details"]["tokens"]]


def test_health_and_info(server):
    assert httpx.get(f"{server}/health", timeout=60).status_code == 200
    info = httpx.get(f"{server}/info", timeout=10).json()
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["model_device_type"] == "cpu" and info["model_dtype"] == "float32"
    assert info["max_batch_total_tokens"] >= 8192


def test_invalid_request_is_422_and_server_keeps_serving(server):
    bad = httpx.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"top_p": 1.5}}, timeout=10)
    assert bad.status_code == 422
    assert bad.json()["error_type"] == "validation" and "top_p" in bad.json()["error"]
    too_long = httpx.post(f"{server}/generate", json={"inputs": "hi " * 5000}, timeout=30)
    assert too_long.status_code == 422 and "max input length" in too_long.json()["error"]
    ok = httpx.post(f"{server}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200
