"""Soak: a live server under a mix of clients for LORAPLEX_SOAK_S seconds (default 20 in `make test`; the full
soak is LORAPLEX_SOAK_S=60 LORAPLEX_SOAK_WARMUP_S=15, or longer by hand).

Concurrent clients run, interleaved: greedy requests over the four shipped adapters and the base model through
both APIs, streamed and not (each answer compared with that request's solo answer, captured first); clients that
leave mid-stream and mid-request (the connection closed); malformed requests (a 4xx, never a 5xx). After it the
running / waiting gauges and KV usage are back to idle and the process's RSS is within a bound of its level after
a warm-up pass of the same mix. The figures are printed (run with -s) for the record.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from tests.helpers import live_server_process, metric_value

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
ADAPTERS = ["name-nova", "name-orion", "name-lyra", "style-caps"]
TARGETS = [None, *ADAPTERS]  # None: the base model
SOAK_S = float(os.environ.get("LORAPLEX_SOAK_S", "20"))
CLIENTS = int(os.environ.get("LORAPLEX_SOAK_CLIENTS", "6"))
WARMUP_S = float(os.environ.get("LORAPLEX_SOAK_WARMUP_S", "10"))
RSS_BOUND_MB = 100  # growth allowed over the post-warm-up level
NEW_TOKENS = 8
QUESTION = "What is your name?"
PROMPT = "My favourite colour is"


@pytest.fixture(scope="module")
def served():
    with live_server_process(
        "--adapter-source", "local", "--adapter-root", str(ROOT), "--preloaded-adapter-ids", *ADAPTERS,
        "--max-batch-total-tokens", "8192", "--max-active-adapters", "8",
    ) as (url, proc):
        yield url, proc


# ---- the requests --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One greedy request: `api` is native, chat or completions; the answer's text is compared across runs."""

    api: str
    target: str | None
    stream: bool

    def request(self, new_tokens: int = NEW_TOKENS) -> tuple[str, dict]:
        if self.api == "native":
            parameters = {"max_new_tokens": new_tokens, "apply_chat_template": True,
                          **({"adapter_id": self.target} if self.target else {})}
            return ("/generate_stream" if self.stream else "/generate"), {"inputs": QUESTION, "parameters": parameters}
        body = {"model": self.target or "", "max_tokens": new_tokens, "temperature": 0, "stream": self.stream}
        if self.api == "chat":
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": QUESTION}]}
        return "/v1/completions", {**body, "prompt": PROMPT}

    def solo_key(self) -> tuple[str, str | None]:
        return self.api, self.target


CALLS = [Call(api, target, stream) for api in ("native", "chat", "completions") for target in TARGETS
         for stream in (False, True)]


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def answer_text(call: Call, response: httpx.Response) -> str:
    """The answer's text (streamed: the pieces joined), or an AssertionError naming what went wrong."""
    assert response.status_code == 200, f"{response.status_code} {response.read()[:300]!r}"
    if not call.stream:
        body = json.loads(response.read())
        if call.api == "native":
            return body["generated_text"]
        choice = body["choices"][0]
        return choice["message"]["content"] if call.api == "chat" else choice["text"]
    pieces = []
    for event in sse_events(response):
        assert "error" not in event, event
        if call.api == "native":
            if event.get("generated_text") is not None:
                return event["generated_text"]
        elif event["choices"]:
            choice = event["choices"][0]
            pieces.append((choice["delta"].get("content") if call.api == "chat" else choice["text"]) or "")
    assert call.api != "native", "the native stream ended without generated_text"
    return "".join(pieces)


def run(client: httpx.Client, call: Call) -> str:
    path, body = call.request()
    with client.stream("POST", path, json=body) as response:
        return answer_text(call, response)


MALFORMED = [  # (path, body): each a 4xx
    ("/generate", {"inputs": "", "parameters": {"max_new_tokens": 2}}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -1}}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 10**9}}),
    ("/generate", {"inputs": "hi", "parameters": {"adapter_id": "no-such-adapter", "max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"temperature": "hot"}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"best_of": 2, "max_new_tokens": 2}}),
    ("/tokenize", {"inputs": "\ud800"}),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 7}),
    ("/v1/completions", {"prompt": [[10**9]], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 10**6}),
]


# ---- clients -------------------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.problems: list[str] = []

    def add(self, what: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if problem:
                self.problems.append(f"{what}: {problem}")


def one_action(client: httpx.Client, url: str, rng: random.Random, solo: dict, tally: Tally) -> None:
    kind = rng.choices(["greedy", "leave_stream", "leave_request", "malformed"], weights=[6, 1, 1, 2])[0]
    if kind == "greedy":
        call = rng.choice(CALLS)
        label = f"greedy {call.api}{' stream' if call.stream else ''}"
        try:
            text = run(client, call)
        except (AssertionError, httpx.HTTPError, ValueError, KeyError) as exc:
            return tally.add(f"{label} error", repr(exc)[:300])
        expected = solo[call.solo_key()]
        return tally.add(label, None if text == expected else f"{call}: {text!r} != solo {expected!r}")
    if kind == "leave_stream":  # read the first event, then close the connection
        call = Call(rng.choice(["native", "chat", "completions"]), rng.choice(TARGETS), True)
        path, body = call.request(new_tokens=64)
        with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return tally.add("leave_stream error", f"{response.status_code} {response.read()[:200]!r}")
            next(response.iter_lines())
        return tally.add("left mid-stream")
    if kind == "leave_request":  # a non-streamed answer the client stops waiting for: its connection closes
        call = Call(rng.choice(["native", "chat", "completions"]), rng.choice(TARGETS), False)
        path, body = call.request(new_tokens=64)
        try:
            with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.3)) as impatient:
                response = impatient.post(path, json=body)
        except httpx.ReadTimeout:
            return tally.add("left mid-request")
        return tally.add("leave_request answered", None if response.status_code == 200 else response.text[:200])
    path, body = rng.choice(MALFORMED)
    # Python's json: the lone surrogate escaped (httpx's own encoder refuses to send it).
    response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    ok = 400 <= response.status_code < 500
    tally.add(f"malformed {response.status_code // 100}xx", None if ok else f"{path} {body}: {response.text[:200]}")


def clients(url: str, seconds: float, solo: dict, seed: int) -> Tally:
    """CLIENTS threads, each running actions until the deadline (at least one each)."""
    tally = Tally()
    deadline = time.monotonic() + seconds

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=300) as client:
            while True:
                try:
                    one_action(client, url, rng, solo, tally)
                except Exception as exc:  # noqa: BLE001 — counted and reported, the client goes on
                    tally.add("client exception", repr(exc)[:300])
                if time.monotonic() > deadline:
                    return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


# ---- measuring -----------------------------------------------------------------------------------

def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "lorax_queue_length", "lorax_batch_current_size")
    found = {}
    for name in names:
        found[name] = metric_value(text, name)
    return found


def idle_gauges(url: str, timeout_s: float = 60) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks (aborted requests drain within a step or two)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = gauges(url)
        if not any(now.values()) or time.monotonic() > deadline:
            return now


def rss_mb(pid: int) -> float:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


# ---- the test ------------------------------------------------------------------------------------

def test_soak_mixed_clients_leave_the_server_idle_and_bounded(served):
    url, proc = served
    with httpx.Client(base_url=url, timeout=300) as client:
        solo = {}
        for call in CALLS:
            if not call.stream:
                solo[call.solo_key()] = run(client, call)
        for call in CALLS:  # streamed answers alone agree with the plain ones
            if call.stream:
                assert run(client, call) == solo[call.solo_key()], call
    assert len(set(solo.values())) > 3, solo  # the adapters answer differently: the comparison can fail

    warm = clients(url, WARMUP_S, solo, seed=0)  # the same mix, shorter: caches and pools filled
    assert idle_gauges(url) == dict.fromkeys(gauges(url), 0.0)
    rss_before = rss_mb(proc.pid)

    started = time.monotonic()
    tally = clients(url, SOAK_S, solo, seed=1)
    elapsed = time.monotonic() - started
    after = idle_gauges(url)
    rss_after = rss_mb(proc.pid)
    health = httpx.get(f"{url}/health", timeout=60).status_code

    done = sum(tally.counts.values())
    print(f"\nsoak: {done} requests in {elapsed:.0f} s by {CLIENTS} clients (warm-up {sum(warm.counts.values())})")
    for what, n in sorted(tally.counts.items()):
        print(f"  {what}: {n}")
    print(f"  problems: {len(tally.problems)}")
    print(f"  RSS after warm-up {rss_before:.0f} MB, after soak {rss_after:.0f} MB ({rss_after - rss_before:+.0f} MB)")
    print(f"  after: {after}; /health {health}")

    assert not warm.problems, warm.problems[:5]
    assert not tally.problems, f"{len(tally.problems)} problems, e.g. {tally.problems[:5]}"
    assert health == 200
    assert after == dict.fromkeys(after, 0.0), f"not idle after the soak: {after}"
    assert rss_after <= rss_before + RSS_BOUND_MB, f"RSS grew {rss_after - rss_before:.0f} MB (bound {RSS_BOUND_MB})"
    # Every kind of action ran (a soak long enough to mean something).
    assert {"left mid-stream", "malformed 4xx"} <= set(tally.counts), tally.counts
