"""Overload: admission limits (--max-concurrent-requests, --max-queued-tokens) answer 429 with Retry-After on
every generating route; a KV cache too small for the admitted work preempts and queues without changing greedy
outputs; nothing hangs and nothing stays in flight."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.server.admission import (
    RETRY_AFTER_MAX_S, Admission, Overloaded, TokenRate, retry_after_seconds,
)
from loraplex.server.app import create_app
from tests.helpers import live_server

MAX_CONCURRENT = 4
# 6 blocks of 16. A request grows by NEW_TOKENS while it runs: a plain prompt (6-8 tokens) from 1 block to 3, a chat
# prompt (36-38 with its template) from 3 to 5. Whatever order the admitted requests arrive in, those running
# together outgrow the cache (three plain ones: 9 blocks; a chat one beside a plain one: 8), so some are preempted.
KV_TOKENS = 96
MAX_QUEUED = 300  # four requests in flight stay under it (at most 2 x 78 + 2 x 48 = 252 tokens)
NEW_TOKENS = 40
OVERALL_TIMEOUT_S = 150


# ---- the estimate and the bookkeeping ------------------------------------------------------------


def test_retry_after_is_the_promised_work_over_the_recent_rate_clamped():
    assert retry_after_seconds(500, None) == 1  # nothing known
    assert retry_after_seconds(500, 0.0) == 1
    assert retry_after_seconds(500, 100.0) == 5
    assert retry_after_seconds(501, 100.0) == 6  # whole seconds, rounded up
    assert retry_after_seconds(0, 100.0) == 1  # never 0
    assert retry_after_seconds(10**9, 1.0) == RETRY_AFTER_MAX_S


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_token_rate_counts_the_recent_window_only():
    clock = Clock(100.2)
    rate = TokenRate(window_s=10, clock=clock)
    assert rate.per_second() is None
    rate.add(50)
    assert rate.per_second() == 50.0  # a burst just begun: over at least one second
    clock.now = 101.5
    rate.add(50)
    clock.now = 102.0
    assert rate.per_second() == 50.0  # 100 tokens since second 100
    clock.now = 110.0
    assert rate.per_second() == pytest.approx(50 / 9)  # second 100 forgotten; 50 tokens since second 101
    clock.now = 111.0
    assert rate.per_second() is None


def test_admission_refuses_past_either_limit_and_gives_everything_back():
    clock = Clock(0.0)
    admission = Admission(rate=TokenRate(clock=clock))
    big = admission.admit(100, 400, max_requests=4, max_tokens=300)  # alone: admitted even past the token limit
    with pytest.raises(Overloaded, match=r"500 tokens queued \+ 11 of this request > 300 \(max queued tokens\)"):
        admission.admit(1, 10, max_requests=4, max_tokens=300)
    admission.release(big)
    seats = [admission.admit(10, 90, max_requests=4, max_tokens=300) for _ in range(3)]
    with pytest.raises(Overloaded, match="max queued tokens"):
        admission.admit(10, 1, max_requests=4, max_tokens=300)
    assert (admission.in_flight, admission.queued_tokens, admission.pending_output_tokens) == (3, 300, 270)
    # 70 tokens made in 2 s: 35 per second; 200 tokens still promised, so about 6 s.
    for _ in range(70):
        admission.generated(seats[0] if seats[0].unspent else seats[1])
    clock.now = 2.0
    with pytest.raises(Overloaded, match=r"3 requests in flight \(max concurrent requests 3\)") as refused:
        admission.admit(1, 1, max_requests=3, max_tokens=None)
    assert refused.value.retry_after == 6
    for seat in seats:
        admission.release(seat)
    assert (admission.in_flight, admission.queued_tokens, admission.pending_output_tokens) == (0, 0, 0)


# ---- every generating route's 429 ----------------------------------------------------------------

ROUTES = [  # (path, body, OpenAI-shaped)
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 8}}, False),
    ("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 8}}, False),
    ("/", {"inputs": "Hi", "stream": True, "parameters": {"max_new_tokens": 8}}, False),
    ("/v1/completions", {"model": "", "prompt": "Hi", "max_tokens": 8}, True),
    ("/v1/completions", {"model": "", "prompt": "Hi", "max_tokens": 8, "stream": True}, True),
    ("/v1/completions", {"model": "", "prompt": "Hi", "max_tokens": 8, "n": 2}, True),
    ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, True),
    ("/v1/chat/completions",
     {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}, True),
]


def assert_overloaded(response: httpx.Response, openai: bool, reason: str) -> int:
    assert response.status_code == 429, response.text
    retry_after = int(response.headers["retry-after"])
    assert 1 <= retry_after <= RETRY_AFTER_MAX_S
    body = response.json()
    if openai:
        assert (body["error"]["type"], body["error"]["code"]) == ("rate_limit_error", "overloaded")
        assert reason in body["error"]["message"]
    else:
        assert body["error_type"] == "overloaded" and reason in body["error"]
    return retry_after


# 8 seats: a request's share (a quarter, server/admission.py sequences_per_request) is 2, so n=2 is admissible.
APP_MAX_CONCURRENT = 8


@pytest.fixture
def app(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=1024))
    yield create_app(engine, ServerConfig(max_concurrent_requests=APP_MAX_CONCURRENT, max_queued_tokens=MAX_QUEUED))
    engine.shutdown()


@pytest.mark.parametrize("full", ["max concurrent requests", "max queued tokens"])
def test_every_generating_route_answers_429_with_retry_after(app, full):
    admission = app.state.loraplex.admission
    # The server's load, set directly: the requests below are refused before they reach the engine.
    if full == "max concurrent requests":
        seats = [admission.admit(1, 1, APP_MAX_CONCURRENT, None) for _ in range(APP_MAX_CONCURRENT)]
    else:
        seats = [admission.admit(10, MAX_QUEUED - 10, APP_MAX_CONCURRENT, None)]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return [await client.post(path, json=body) for path, body, _ in ROUTES]

    responses = asyncio.run(main())
    for (path, _, openai), response in zip(ROUTES, responses):
        assert_overloaded(response, openai, full)
    for seat in seats:
        admission.release(seat)
    assert (admission.in_flight, admission.queued_tokens) == (0, 0)  # the refused took nothing


# ---- a live server under a burst, on a KV cache too small for it ---------------------------------


@pytest.fixture(scope="module")
def server():
    with live_server("--max-concurrent-requests", str(MAX_CONCURRENT), "--max-batch-total-tokens", str(KV_TOKENS),
                     "--max-queued-tokens", str(MAX_QUEUED)) as url:
        yield url


PROMPTS = ["Count from one to ten:", "Write a haiku about the sea."]


def request_for(api: str, prompt: str, stream: bool) -> tuple[str, dict]:
    if api == "native":
        params = {"max_new_tokens": NEW_TOKENS, "ignore_eos_token": True}
        return ("/generate_stream" if stream else "/generate"), {"inputs": prompt, "parameters": params}
    common = {"model": "", "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if api == "completions":
        return "/v1/completions", {"prompt": prompt, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}


def text_of(api: str, stream: bool, payloads: list[dict]) -> str:
    """The generated text of a whole answer (one payload) or of a stream's events."""
    if api == "native":
        return payloads[-1]["generated_text"]
    if api == "completions":
        return "".join(c["text"] for p in payloads for c in p["choices"])
    if not stream:
        return payloads[0]["choices"][0]["message"]["content"]
    return "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])


async def ask(client: httpx.AsyncClient, api: str, prompt: str, stream: bool) -> tuple[str, object]:
    """("ok", text) or ("429", Retry-After); anything else fails the test."""
    path, body = request_for(api, prompt, stream)
    async with client.stream("POST", path, json=body) as response:
        await response.aread()
        if response.status_code == 429:
            return "429", assert_overloaded(response, api != "native", "overloaded")
        assert response.status_code == 200, response.text
        if not stream:
            return "ok", text_of(api, stream, [response.json()])
        lines = response.text.splitlines()
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line != "data: [DONE]"]
        assert not any("error" in e for e in events), events
        return "ok", text_of(api, stream, events)


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if set(s.labels) <= {"model_name"}}  # vLLM's series carry the model's name


def test_a_burst_completes_with_solo_outputs_or_gets_429_and_nothing_stays_in_flight(server):
    cases = [(api, prompt) for api in ("native", "completions", "chat") for prompt in PROMPTS]

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=OVERALL_TIMEOUT_S) as client:
            solo = {}
            for api, prompt in cases:  # one at a time: each alone in the engine
                status, solo[api, prompt] = await ask(client, api, prompt, stream=False)
                assert status == "ok"
            preempted_before = scrape(server)["vllm:num_preemptions_total"]
            # 3x the concurrency limit at once: both APIs, streamed and not, the APIs interleaved. The first
            # arrivals are admitted; a second wave, in the reverse order, lets the other APIs arrive first.
            burst = [(api, prompt, stream) for prompt in PROMPTS for stream in (False, True)
                     for api in ("native", "completions", "chat")]
            waves = []
            for wave in (burst, burst[::-1]):
                results = await asyncio.gather(*(ask(client, *request) for request in wave))
                waves.append(list(zip(wave, results)))
            return solo, preempted_before, waves

    solo, preempted_before, waves = asyncio.run(asyncio.wait_for(main(), OVERALL_TIMEOUT_S))
    for results in waves:
        done = [(request, text) for request, (status, text) in results if status == "ok"]
        refused = [request for request, (status, _) in results if status == "429"]
        assert len(done) + len(refused) == 3 * MAX_CONCURRENT
        assert len(done) >= MAX_CONCURRENT and refused, results
        print(f"burst of {len(results)}: {len(done)} completed with their solo output, {len(refused)} got 429")
        for (api, prompt, stream), text in done:
            assert text == solo[api, prompt], (api, prompt, stream)
    completed_apis = {api for results in waves for (api, _, _), (status, _) in results if status == "ok"}
    assert "native" in completed_apis and completed_apis & {"completions", "chat"}, waves
    metrics = scrape(server)
    # The cache could not hold the admitted requests at once: some were preempted, and still answered exactly.
    assert metrics["vllm:num_preemptions_total"] > preempted_before
    print(f"preemptions: {metrics['vllm:num_preemptions_total'] - preempted_before:.0f}")
    nothing = {name: metrics[name] for name in (
        "loraplex_requests_in_flight", "loraplex_queued_tokens", "vllm:num_requests_running",
        "vllm:num_requests_waiting")}
    assert set(nothing.values()) == {0.0}, nothing
    info = httpx.get(f"{server}/info", timeout=10).json()
    assert (info["max_concurrent_requests"], info["max_queued_tokens"]) == (MAX_CONCURRENT, MAX_QUEUED)
    assert info["max_batch_total_tokens"] == KV_TOKENS


def test_a_request_that_can_never_fit_the_kv_cache_is_refused_at_once(server):
    # Prompt + max_new_tokens over the whole cache: it could never run, so it must not wait.
    native = httpx.post(f"{server}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": KV_TOKENS}},
                        timeout=30)
    assert native.status_code == 422 and f"<= {KV_TOKENS} (max total tokens)" in native.json()["error"]
    openai = httpx.post(f"{server}/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": KV_TOKENS},
                        timeout=30)
    assert openai.status_code == 400 and f"<= {KV_TOKENS} (max total tokens)" in openai.json()["error"]["message"]
