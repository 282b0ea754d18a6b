"""The real `loraplex serve` process on 127.0.0.1, driven over HTTP with httpx."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers import metric_value

@pytest.fixture(scope="module")
def server(api_server):
    return api_server


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


def read_events(response) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in response.iter_lines() if line.startswith("data:")]


def test_compat_route_lists_and_streams(server):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}, "stream": False}
    answer = httpx.post(f"{server}/", json=body, timeout=60)
    assert answer.status_code == 200 and isinstance(answer.json(), list) and len(answer.json()) == 1
    with httpx.stream("POST", f"{server}/", json={**body, "stream": True}, timeout=60) as response:
        events = read_events(response)
    assert events[-1]["generated_text"] == answer.json()[0]["generated_text"]


def test_headers_full_text_truncate_and_tokenize(server):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 5, "return_full_text": True,
                                                                  "decoder_input_details": True, "details": True}}
    answer = httpx.post(f"{server}/generate", json=body, timeout=60)
    data = answer.json()
    assert data["generated_text"].startswith("The capital of France is")
    assert answer.headers["x-generated-tokens"] == "5" and answer.headers["x-model-id"].endswith("SmolLM2-135M-Instruct")
    for name in ("x-compute-time", "x-total-time", "x-queue-time", "x-time-per-token", "x-prompt-tokens"):
        assert name in answer.headers
    tokens = httpx.post(f"{server}/tokenize", json={"inputs": "The capital of France is"}, timeout=10).json()
    assert [t["id"] for t in data["details"]["prefill"]] == [t["id"] for t in tokens]
    assert data["details"]["prefill"][0]["logprob"] is None and data["details"]["prefill"][1]["logprob"] < 0
    truncated = httpx.post(f"{server}/generate", json={"inputs": "one two three four five six",
                                                        "parameters": {"max_new_tokens": 1, "truncate": 2, "details": True}}, timeout=60)
    assert truncated.json()["details"]["prompt_tokens"] == 2


def test_best_of_is_bounded_by_max_best_of_and_a_requests_share_of_the_seats(server):
    # This server's 4 seats give a request a share of 1 sequence (server/admission.py sequences_per_request):
    # best_of=2 is refused before any work. Its answer (best_of_sequences) is tested where the share allows it:
    # test_lorax_client (128 seats), test_fair_sequences (8).
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 6, "best_of": 2, "do_sample": True,
                                                          "details": True}}
    over_share = httpx.post(f"{server}/generate", json=body, timeout=60)
    assert over_share.status_code == 422
    assert over_share.json()["error"].startswith("best_of must be <= 1 (--max-sequences-per-request")
    over_max = httpx.post(f"{server}/generate", json={**body, "parameters": {**body["parameters"], "best_of": 3}},
                          timeout=10)
    assert over_max.status_code == 422 and "max best of" in over_max.json()["error"]


def test_limits_are_refused_with_the_limit_named(server):
    too_many_stops = httpx.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"stop": list("abcde")}}, timeout=10)
    assert too_many_stops.status_code == 422 and "max stop sequences" in too_many_stops.json()["error"]
    too_long = httpx.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 100000}}, timeout=10)
    assert too_long.status_code == 422 and "max total tokens" in too_long.json()["error"]
    assert httpx.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"temperature": 0}}, timeout=10).status_code == 422


def test_fifth_concurrent_request_gets_429_and_slots_come_back(server):
    # Long enough that none can finish while the test holds them open.
    body = {"inputs": "Count to one hundred:", "parameters": {"max_new_tokens": 3000, "ignore_eos_token": True}}
    with httpx.Client(timeout=60) as client:
        streams = [client.stream("POST", f"{server}/generate_stream", json=body) for _ in range(4)]
        opened = [s.__enter__() for s in streams]
        try:
            # Keep the line iterators alive: a discarded one closes its connection (and the server aborts).
            lines = [response.iter_lines() for response in opened]
            for it in lines:  # each has produced a token: all four hold a slot
                next(it)
            refused = httpx.post(f"{server}/generate", json={"inputs": "hi"}, timeout=10)
            assert refused.status_code == 429 and refused.json()["error_type"] == "overloaded"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert "lorax_request_failure{err=\"overloaded\"}" in metrics
    # The closed streams were aborted: a new request gets through.
    assert httpx.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60).status_code == 200


def gauge(metrics_text: str, name: str) -> float:
    return metric_value(metrics_text, name)


def test_disconnected_streams_are_aborted_and_free_the_kv_cache(server):
    body = {"inputs": "Write a very long essay about the sea.", "parameters": {"max_new_tokens": 3000, "ignore_eos_token": True}}
    with httpx.Client(timeout=60) as client:
        for _ in range(4):  # 16 streams in all, 4 at a time (the server's concurrency limit)
            streams = [client.stream("POST", f"{server}/generate_stream", json=body) for _ in range(4)]
            opened = [s.__enter__() for s in streams]
            lines = [r.iter_lines() for r in opened]
            for it in lines:
                for _ in range(3):  # a few tokens each
                    next(it)
            for s in streams:
                s.__exit__(None, None, None)
    # The server notices each disconnect on its own schedule: wait (bounded) for the engine to go idle.
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(f"{server}/metrics", timeout=10).text
        idle = gauge(metrics, "vllm:num_requests_running") == 0 and gauge(metrics, "vllm:kv_cache_usage_perc") == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, metrics


METRIC_NAMES = (
    "lorax_request_count", "lorax_request_success", "lorax_request_failure", "lorax_request_duration",
    "lorax_request_queue_duration", "lorax_request_mean_time_per_token_duration", "lorax_request_generated_tokens",
    "lorax_request_input_length", "lorax_queue_length", "lorax_batch_current_size", "vllm:num_requests_waiting",
    "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info",
)


def sample(metrics_text: str, prefix: str) -> float:
    return sum(float(l.split()[-1]) for l in metrics_text.splitlines() if l.startswith(prefix))


def test_metrics_exist_and_move(server):
    before = httpx.get(f"{server}/metrics", timeout=10).text
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in before, name
    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 5, "ignore_eos_token": True}}
    assert httpx.post(f"{server}/generate", json=body, timeout=60).status_code == 200
    assert httpx.post(f"{server}/generate", json={"inputs": "x", "parameters": {"stop": list("abcdef")}}, timeout=10).status_code == 422
    after = httpx.get(f"{server}/metrics", timeout=10).text
    assert sample(after, "lorax_request_count{") == sample(before, "lorax_request_count{") + 1
    assert sample(after, "lorax_request_success{") == sample(before, "lorax_request_success{") + 1
    assert sample(after, "lorax_request_generated_tokens_sum") == sample(before, "lorax_request_generated_tokens_sum") + 5
    assert sample(after, "lorax_request_duration_count") == sample(before, "lorax_request_duration_count") + 1
    assert sample(after, 'lorax_request_failure{err="validation"}') == sample(before, 'lorax_request_failure{err="validation"}') + 1


def test_openapi_docs_are_served_offline(server):
    page = httpx.get(f"{server}/docs", timeout=10)
    assert page.status_code == 200 and "/docs-static/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower()
    assert httpx.get(f"{server}/docs-static/swagger-ui-bundle.js", timeout=10).status_code == 200
    schema = httpx.get(f"{server}/openapi.json", timeout=10).json()
    assert {"/generate", "/generate_stream", "/tokenize"} <= set(schema["paths"])
