"""SIGTERM drains with a deadline (--shutdown-timeout-s): streams still running when it passes end with an error
event in their API's shape ("server shutting down"; OpenAI's then [DONE]), and the process exits 0 soon after."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.helpers import live_server_process

DEADLINE_S = 2.0


def test_sigterm_ends_long_streams_with_an_error_event_at_the_deadline():
    with live_server_process("--shutdown-timeout-s", str(DEADLINE_S)) as (url, proc):
        streams = {
            "native": ("/generate_stream", {"inputs": "Tell me a story.",
                                            "parameters": {"max_new_tokens": 3000, "ignore_eos_token": True}}),
            "openai": ("/v1/completions", {"model": "", "prompt": "Tell me a story.", "max_tokens": 3000,
                                           "stream": True, "ignore_eos": True}),
        }
        events: dict[str, list[str]] = {name: [] for name in streams}
        flowing = {name: threading.Event() for name in streams}

        def read(name: str) -> None:
            path, body = streams[name]
            with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events[name].append(line[5:].strip())
                        flowing[name].set()

        readers = [threading.Thread(target=read, args=(name,)) for name in streams]
        for reader in readers:
            reader.start()
        assert all(f.wait(timeout=120) for f in flowing.values()), "the streams never started"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=60)
        ended = time.monotonic() - signalled
        assert proc.wait(timeout=30) == 0
        exited = time.monotonic() - signalled
    assert DEADLINE_S <= ended < DEADLINE_S + 5, f"the streams ended {ended:.1f} s after SIGTERM"
    native_last = json.loads(events["native"][-1])
    assert native_last == {"error": "server shutting down", "error_type": "unavailable"}
    assert events["openai"][-1] == "[DONE]"
    openai_last = json.loads(events["openai"][-2])
    assert openai_last["error"]["message"] == "server shutting down" and openai_last["error"]["code"] == "unavailable"
    assert len(events["native"]) > 2 and len(events["openai"]) > 3  # tokens came before the end
    print(f"streams ended {ended:.2f} s and the process {exited:.2f} s after SIGTERM (deadline {DEADLINE_S} s)")
