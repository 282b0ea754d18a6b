"""Smoke test of the benchmark machinery on a tiny random model (the HF model itself is the peer). No speed asserted."""

from __future__ import annotations

import pytest
import torch

from benchmarks import systems as systems_module
from benchmarks.adapters import bench_adapters, format_adapter_result
from benchmarks.offline import bench_workload, format_result
from benchmarks.peers import HFBatched, HFOneAtATime
from benchmarks.systems import Loraplex
from benchmarks.workload import equal_workload, mixed_workload, round_robin
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
    monkeypatch.setattr(systems_module, "perf_counter", lambda: next(ticks))

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
    monkeypatch.setattr(systems_module, "perf_counter", lambda: next(ticks))
    result = bench_workload(workload, *systems, one_at_a_time_requests=1, repeats=2)
    assert (result.ours.seconds, result.batched.seconds, result.one_at_a_time.seconds) == (1.0, 1.0, 1.0)
    assert "best of 2" in format_result(result, "cpu float32, 1 threads")


# ---- the adapters workload, reduced: 4 requests over 2 adapters (8 prompt / 4 new tokens), and 4 adapters
# rotating through 2 slots ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_systems():
    from benchmarks.adapters import (
        AdapterSpec,
        PEFTMixed,
        adapter_from_peft,
        make_peft_model,
        random_adapter,
    )

    hf = tiny_hf_model(seed=1)
    model, config = ours_from_hf(hf)  # a copy: PEFT then wraps `hf` in place
    spec = AdapterSpec(rank=4, alpha=8.0)
    names, rotation_ids = ["a0", "a1"], [f"r{i}" for i in range(4)]
    peft_model = make_peft_model(hf, names, spec, seed=5)
    engine = engine_for(model, config, max_active_adapters=4)
    rotation_engine = engine_for(model, config, max_active_adapters=2)
    adapters = {n: adapter_from_peft(peft_model, n, engine.lora.base_shapes, 16) for n in names}
    rotating = {n: random_adapter(n, engine.lora.base_shapes, spec, 16, seed=i) for i, n in enumerate(rotation_ids)}
    systems = (Loraplex(engine, adapters, name="loraplex, 2 adapters"), Loraplex(engine), PEFTMixed(peft_model),
               Loraplex(rotation_engine, rotating, name="loraplex rotating adapters"))
    workload = round_robin(equal_workload(4, 256, [0, 1, 2], prompt_len=8, new_tokens=4, seed=3), names, "adapters")
    rotation = round_robin(equal_workload(4, 256, [0, 1, 2], prompt_len=8, new_tokens=4, seed=3), rotation_ids)
    return systems, workload, rotation, spec, adapters, peft_model


def test_adapters_converted_from_peft_keep_its_weights_and_scale(adapter_systems):
    *_, adapters, peft_model = adapter_systems
    layer = peft_model.base_model.model.model.layers[1].mlp.down_proj
    ours = adapters["a1"].modules["model.layers.1.mlp.down_proj"]
    assert torch.equal(ours.a, layer.lora_A["a1"].weight) and torch.equal(ours.b, layer.lora_B["a1"].weight)
    assert ours.scale == layer.scaling["a1"] == 2.0 and ours.b.abs().sum() > 0  # B random, not PEFT's zeros
    assert len(adapters["a0"].modules) == 7 * 2  # seven projections x two layers


def test_adapter_workload_structure_token_match_and_rotation(adapter_systems):
    systems, workload, rotation, spec, *_ = adapter_systems
    assert workload.describe() == "4 requests x 8 prompt / 4 new tokens, round-robin over 2 adapters"
    assert workload.adapter_ids == ["a0", "a1", "a0", "a1"] and workload.head(3).adapter_ids == ["a0", "a1", "a0"]

    result = bench_adapters(workload, rotation, *systems, spec, rotation_slots=2, repeats=2)

    assert result.identical_to_peft == 4  # float32: loraplex's greedy tokens equal PEFT's mixed batch
    assert result.differ_from_base >= 1  # the adapters do change the output
    assert all(t.tokens == 16 and t.requests == 4 for t in (result.adapters, result.base, result.peft, result.rotation))
    assert result.rotation.stats["installs"] >= 4 and result.rotation.stats["max_running"] <= 2  # 4 adapters, 2 slots
    assert result.adapters.stats["max_running"] == 4  # all at once: both adapters hold a slot
    text = format_adapter_result(result, "cpu float32, 1 threads")
    for needle in ("workload adapters: 4 requests x 8 prompt / 4 new tokens, round-robin over 2 adapters",
                   "rank 4, alpha 8, on q,k,v,o,gate,up,down", "best of 2", "loraplex, base model",
                   "PEFT mixed-adapter batch", "loraplex, 4 adapters / 2 slots", "target >= 1.50x", "target >= 0.85x",
                   "4/4 requests' greedy tokens identical to PEFT's"):
        assert needle in text, (needle, text)
    figures = result.to_json()
    assert figures["identical_to_peft"] == [4, 4] and figures["rotation"]["max_active_adapters"] == 2
    assert set(figures["ratios"]) == {"peft_mixed", "base", "rotation_vs_adapters"}
    assert figures["ratios"]["base"] == pytest.approx(result.adapters.tokens_per_s / result.base.tokens_per_s)


def test_adapter_ratios_from_measured_times(adapter_systems, monkeypatch):
    from benchmarks import adapters as adapters_module

    systems, workload, rotation, spec, *_ = adapter_systems
    # A fake clock: loraplex with adapters 1 s, base 0.8 s, PEFT 2 s, rotation 4 s.
    ticks = iter([0.0, 1.0, 10.0, 10.8, 20.0, 22.0, 30.0, 34.0])
    monkeypatch.setattr(adapters_module, "perf_counter", lambda: next(ticks))
    result = bench_adapters(workload, rotation, *systems, spec, rotation_slots=2)
    assert result.ratios == pytest.approx({"peft_mixed": 2.0, "base": 0.8, "rotation_vs_adapters": 0.25})
    text = format_adapter_result(result, "cpu float32, 1 threads")
    assert "= 2.00x (target >= 1.50x, met)" in text and "= 0.80x (target >= 0.85x, NOT met)" in text
    assert "= 0.25x loraplex with 2 adapters" in text


def test_the_cli_passes_bench_options_through(capsys):
    from loraplex.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--workload", "vision", "--help"])
    assert exit_info.value.code == 0
    assert "--workload {equal,mixed,adapters,vision,seq2seq,embeddings,all}" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")


def test_the_embeddings_workload_on_a_tiny_model(tmp_path):
    """benchmarks/embeddings.py: loraplex's vectors equal transformers' (the sanity line), and the ratios are the
    measured times' (a tiny random model; no speed asserted)."""
    import argparse

    from benchmarks.embeddings import bench_embeddings, format_embeddings

    hf = tiny_hf_model()
    model, config = ours_from_hf(hf)
    engine = engine_for(model, config, max_active_adapters=2)

    class Tokenizer:  # what the workload reads of the engine's tokenizer
        hf = argparse.Namespace(all_special_ids=[0, 1, 2])

    engine.tokenizer = Tokenizer()
    args = argparse.Namespace(requests=6, adapters=2, seed=1, repeats=1)
    result = bench_embeddings(engine, hf, 0, args, log=lambda line: None)
    assert result["inputs"] == 6 and result["max_abs_diff"] < 1e-4 and result["loraplex_adapters_s"] > 0
    text = format_embeddings(result, "cpu float32")
    assert f"loraplex = {result['transformers_s'] / result['loraplex_s']:.2f}x" in text and "sanity" in text
