"""LoRAX's batch metrics under its router's names: the step recorder (engine/step_metrics.py) counts steps by method,
their failures and seconds, and the requests each step starts; /metrics writes them as LoRAX does (counters under
bare names), with `lorax_request_max_new_tokens` and the running batch's reserved tokens."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.stats import EngineStats
from loraplex.engine.step_metrics import NEXT_SIZE_BUCKETS, StepMetrics
from loraplex.params import SamplingParams
from loraplex.server.app import create_app
from loraplex.server.metrics import Metrics
from tests.helpers import asgi_calls

BATCH_COUNTERS = ("lorax_batch_inference_count", "lorax_batch_inference_success", "lorax_batch_inference_failure")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduled(*requests) -> list[SimpleNamespace]:
    """ScheduledRequest stand-ins: (computed tokens, prompt length, started before)."""
    return [SimpleNamespace(request=SimpleNamespace(num_computed_tokens=computed, prompt_ids=[0] * prompt,
                                                    first_scheduled_time=1.0 if started else None))
            for computed, prompt, started in requests]


def run_step(recorder: StepMetrics, clock: Clock, items, seconds: float, contained_failure: bool = False) -> None:
    with recorder.step():
        recorder.begin(items)
        clock.now += seconds
        if contained_failure:
            recorder.failed()


def test_the_recorder_counts_steps_by_method_failures_seconds_and_started_requests():
    clock = Clock()
    recorder = StepMetrics(clock)
    empty = recorder.snapshot
    # Prefill: two new requests and one decoding (prompt rows: a step with any is a prefill).
    run_step(recorder, clock, scheduled((0, 5, False), (3, 5, False), (6, 5, True)), 0.003)
    first = recorder.snapshot
    run_step(recorder, clock, scheduled((6, 5, True), (5, 5, True)), 0.02)  # decode, nothing new
    run_step(recorder, clock, scheduled((7, 5, True)), 0.04, contained_failure=True)  # decode, contained failure
    with pytest.raises(RuntimeError, match="boom"), recorder.step():  # a step that raises: a prefill failure
        recorder.begin(scheduled((0, 9, False)))
        raise RuntimeError("boom")
    with recorder.step():  # nothing ran: not counted
        recorder.begin([])
    with recorder.step():
        pass

    s = recorder.snapshot
    assert s.count == {"prefill": 2, "decode": 2}
    assert s.success == {"prefill": 1, "decode": 1}
    assert s.failure == {"prefill": 1, "decode": 1}
    # Seconds of successful steps only (as LoRAX): 0.003 s at or below the 0.005 bound, not 0.0025; 0.02 s by 0.025.
    prefill, decode = dict(s.duration["prefill"].cumulative()), dict(s.duration["decode"].cumulative())
    assert (prefill[0.0025], prefill[0.005], prefill[float("inf")]) == (0, 1, 1)
    assert (decode[0.01], decode[0.025], decode[float("inf")]) == (0, 1, 1)
    assert s.duration["prefill"].sum == pytest.approx(0.003) and s.duration["decode"].sum == pytest.approx(0.02)
    # Requests started: 2 in the first step, 1 in the step that raised; steps that started none observe nothing.
    assert s.next_size.count == 2 and s.next_size.sum == 3
    sizes = dict(s.next_size.cumulative())
    assert (sizes[1.0], sizes[2.0], sizes[1024.0]) == (1, 2, 2) and len(sizes) == len(NEXT_SIZE_BUCKETS) + 1
    # Snapshots are published whole: one taken earlier does not move.
    assert first.count == {"prefill": 1, "decode": 0} and first.next_size.sum == 2
    assert empty.count == {"prefill": 0, "decode": 0} and empty.next_size.count == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_steps_are_counted_plain_and_overlapped(make_engine, overlap):
    engine = make_engine(overlap_steps=overlap)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    requests = [engine.add_request([1, 2, 3, 4, 5], params), engine.add_request([6, 7, 8], params)]
    assert engine.stats().batch_max_tokens == 0  # none runs yet
    outputs = engine.step()  # both prompts in one step
    assert engine.stats().batch_max_tokens == (5 + 4) + (3 + 4)  # reserved: prompt + max_new_tokens each
    while engine.has_unfinished:
        outputs += engine.step()
    assert all(o.error is None for o in outputs) and {o.request_id for o in outputs if o.finished} == {
        r.request_id for r in requests}
    s = engine.stats().steps
    assert engine.stats().batch_max_tokens == 0
    assert s.count["prefill"] == 1 and s.failure == {"prefill": 0, "decode": 0}
    # Three more tokens each: three decode steps (an overlapped loop may launch one more, whose tokens it drops).
    assert 3 <= s.count["decode"] <= 4 if overlap else s.count["decode"] == 3
    assert s.success == s.count
    assert {m: h.count for m, h in s.duration.items()} == s.count
    assert (s.next_size.count, s.next_size.sum) == (1, 2)


def test_a_contained_failure_and_a_step_that_raises_count_as_failures(make_engine):
    engine = make_engine()
    execute, calls = engine.runner.execute, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device hiccup")
        return execute(*args, **kwargs)

    engine.runner.execute = fails_once
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.step()  # the prefill raises, is run again alone (containment.py) and fails its request
    s = engine.stats().steps
    assert s.count["prefill"] == 1 and s.failure["prefill"] == 1 and s.success["prefill"] == 0
    assert s.duration["prefill"].count == 0
    assert not engine.has_unfinished

    engine.runner.execute = execute
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))

    def broken_update(plan, results):
        raise RuntimeError("update broke")

    engine._update = broken_update
    with pytest.raises(RuntimeError, match="update broke"):
        engine.step()
    s = engine.stats().steps
    assert s.count["prefill"] == 2 and s.failure["prefill"] == 2 and s.next_size.sum == 2


def scrape(app) -> tuple[str, dict]:
    (response,) = asgi_calls(app, ("GET", "/metrics", None))
    return response.text, {f.name: f for f in text_string_to_metric_families(response.text)}


def value(families: dict, family: str, sample: str, **labels) -> float:
    found = [s.value for s in families[family].samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, (family, sample, labels, families[family].samples)
    return found[0]


def test_batch_metrics_follow_the_requests_sent(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    app = create_app(engine, ServerConfig())
    sent = [3, 5, 2]
    body = lambda n: {"inputs": "Hello there", "parameters": {"max_new_tokens": n, "ignore_eos_token": True}}  # noqa: E731
    try:
        responses = asgi_calls(app, ("POST", "/generate", body(sent[0])), ("POST", "/generate_stream", body(sent[1])),
                               ("POST", "/generate", body(sent[2])))
        assert [r.status_code for r in responses] == [200, 200, 200]
        text, families = scrape(app)
    finally:
        engine.shutdown()

    assert families["lorax_request_max_new_tokens"].type == "histogram"
    assert value(families, "lorax_request_max_new_tokens", "lorax_request_max_new_tokens_count") == len(sent)
    assert value(families, "lorax_request_max_new_tokens", "lorax_request_max_new_tokens_sum") == sum(sent)
    assert value(families, "lorax_request_max_new_tokens", "lorax_request_max_new_tokens_bucket", le="2.0") == 1

    for name in BATCH_COUNTERS:  # LoRAX's counters: bare names, typed counter, one series per method
        assert families[name].type == "counter", name
        assert re.search(rf"^# TYPE {name} counter$", text, re.M) and f"{name}_total" not in text, name
        assert re.search(rf'^{name}{{method="decode"}} ', text, re.M), name
        assert {s.labels["method"] for s in families[name].samples} == {"prefill", "decode"}, name
    # (The parser names a counter's samples `<name>_total`, whatever the text wrote.)
    count = {m: value(families, "lorax_batch_inference_count", "lorax_batch_inference_count_total", method=m)
             for m in ("prefill", "decode")}
    success = {m: value(families, "lorax_batch_inference_success", "lorax_batch_inference_success_total", method=m)
               for m in ("prefill", "decode")}
    # One after the other: each request's prompt in a prefill step, its other tokens in decode steps.
    assert count["prefill"] == len(sent) and count["decode"] == sum(n - 1 for n in sent)
    assert success == count
    assert value(families, "lorax_batch_inference_failure", "lorax_batch_inference_failure_total", method="prefill") == 0

    duration = families["lorax_batch_inference_duration"]
    assert duration.type == "histogram"
    for method in ("prefill", "decode"):
        assert value(families, "lorax_batch_inference_duration", "lorax_batch_inference_duration_count",
                     method=method) == count[method]
        assert value(families, "lorax_batch_inference_duration", "lorax_batch_inference_duration_sum",
                     method=method) > 0
    assert families["lorax_batch_next_size"].type == "histogram"
    assert value(families, "lorax_batch_next_size", "lorax_batch_next_size_sum") == len(sent)  # every request started
    assert value(families, "lorax_batch_next_size", "lorax_batch_next_size_count") == len(sent)  # one per step
    assert value(families, "lorax_batch_next_size", "lorax_batch_next_size_bucket", le="1.0") == len(sent)
    assert families["lorax_batch_current_max_tokens"].type == "gauge"
    assert value(families, "lorax_batch_current_max_tokens", "lorax_batch_current_max_tokens") == 0  # none running


def test_the_running_batch_reserved_tokens_are_read_at_scrape_time():
    stats = EngineStats(num_waiting=0, num_running=2, kv_cache_usage=0.1, state_cache_usage=None,
                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, encoded_images=None,
                        vision_encoder_seconds=None, spec_draft_tokens=0, spec_accepted_tokens=0, running_adapters=(),
                        waiting_adapters=(), max_adapters=4, batch_max_tokens=321)
    metrics = Metrics("m", lambda: stats)
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    assert value(families, "lorax_batch_current_max_tokens", "lorax_batch_current_max_tokens") == 321
    assert value(families, "lorax_batch_inference_count", "lorax_batch_inference_count_total", method="decode") == 0
