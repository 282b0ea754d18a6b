"""Smoke test of the benchmark machinery on a tiny random model (the HF model itself is the peer). No speed asserted."""

from __future__ import annotations

import pytest

from benchmarks import offline
from benchmarks.offline import Loraplex, bench_workload, format_result
from benchmarks.peers import HFBatched, HFOneAtATime
from benchmarks.workload import equal_workload, mixed_workload
from tests.helpers import engine_for, ours_from_hf, tiny_hf_model

WORKLOADS = {
    "equal": lambda: equal_workload(4, 256, special_ids=[0, 1, 2], prompt_len=12, new_tokens=6, seed=3),
    "mixed": lambda: mixed_workload(4, 256, special_ids=[0, 1, 2], prompt_lens=(3, 20), new_tokens=(2, 9), seed=3),
}


@pytest.fixture(scope="module")
def systems():
    hf = tiny_hf_model()
    model, config = ours_from_hf(hf)
    return Loraplex(engine_for(model, config)), HFBatched(hf), HFOneAtATime(hf)


def test_workloads_are_deterministic_exact_and_avoid_special_ids():
    w = mixed_workload(16, 40, special_ids=[0, 1, 39], prompt_lens=(3, 9), new_tokens=(1, 4), seed=7)
    assert w == mixed_workload(16, 40, special_ids=[0, 1, 39], prompt_lens=(3, 9), new_tokens=(1, 4), seed=7)
    assert w != mixed_workload(16, 40, special_ids=[0, 1, 39], prompt_lens=(3, 9), new_tokens=(1, 4), seed=8)
    assert all(3 <= len(p) <= 9 for p in w.prompts) and all(1 <= n <= 4 for n in w.max_new_tokens)
    assert {t for p in w.prompts for t in p} <= set(range(2, 39))
    e = equal_workload(5, 40, [0], prompt_len=4, new_tokens=3)
    assert [len(p) for p in e.prompts] == [4] * 5 and e.new_tokens == 15
    assert e.describe() == "5 requests x 4 prompt / 3 new tokens"


@pytest.mark.parametrize("name", WORKLOADS)
def test_runs_give_requested_token_counts_and_ratios_from_measured_times(systems, name, monkeypatch):
    workload = WORKLOADS[name]()
    # A fake clock: loraplex takes 1 s, transformers batched 2 s, one-at-a-time 4 s.
    ticks = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0])
    monkeypatch.setattr(offline, "perf_counter", lambda: next(ticks))

    result = bench_workload(workload, *systems, one_at_a_time_requests=2)

    first_two = sum(workload.max_new_tokens[:2])
    assert (result.ours.tokens, result.batched.tokens, result.one_at_a_time.tokens) == (
        workload.new_tokens, workload.new_tokens, first_two)
    assert (result.ours.seconds, result.batched.seconds, result.one_at_a_time.seconds) == (1.0, 2.0, 4.0)
    text = format_result(result, "cpu float32, 1 threads")
    assert f"{workload.new_tokens:.1f} tok/s" in text
    assert f"loraplex = {2.0:.2f}x" in text
    assert f"loraplex = {workload.new_tokens / (first_two / 4.0):.2f}x" in text
    assert f"{result.identical}/2 requests" in text
    assert ("counts only the" in text) == (name == "mixed")
    assert result.to_json()["ratios"]["batched"] == 2.0


def test_repeats_keep_each_systems_best_time(systems, monkeypatch):
    workload = WORKLOADS["equal"]()
    # Round 1: loraplex 3 s, batched 1 s, one-at-a-time 1 s; round 2: 1 s, 2 s, 4 s.
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 42.0, 50.0, 54.0])
    monkeypatch.setattr(offline, "perf_counter", lambda: next(ticks))
    result = bench_workload(workload, *systems, one_at_a_time_requests=1, repeats=2)
    assert (result.ours.seconds, result.batched.seconds, result.one_at_a_time.seconds) == (1.0, 1.0, 1.0)
    assert "best of 2" in format_result(result, "cpu float32, 1 threads")
