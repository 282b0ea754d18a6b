"""Smoke test of the GPU benchmark (benchmarks/gpu.py) on CPU at tiny shapes (`--smoke`): every workload and system
runs, the tables and JSON carry their fields, and the roofline's and the online workload's arithmetic is checked.
No speed is asserted."""

from __future__ import annotations

import json
import pstats
import statistics

import pytest
import torch

from benchmarks import gpu, roofline
from benchmarks.online import RequestTimes, online_workload, percentile


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: intra-op threads only spin on a shared CPU
    yield tmp_path_factory.mktemp("gpu") / "gpu.json"
    torch.set_num_threads(threads)


def test_smoke_run_prints_every_table_and_writes_json(smoke_run, capsys):
    assert gpu.main(["--smoke", "--json", str(smoke_run)]) == 0
    text = capsys.readouterr().out
    for needle in ("device CPU, float32; torch", "load average", "copy bandwidth:", "read + write traffic",
                   "workload 135m:", "workload 8b:", "workload 8b-single:", "workload 8b-64:",
                   "headline: decode at", "with adapters,", "adapters / base decode =",
                   "| system | s | output tok/s | prefill s | decode tok/s | roofline tok/s | of roofline |",
                   "loraplex, 2 adapter(s)", "loraplex, base model", "transformers batched", "PEFT mixed-adapter batch",
                   "loraplex+adapters / PEFT mixed =", "loraplex base / transformers batched =",
                   "loraplex+adapters / loraplex base =", "roofline: a decode step reads weights",
                   "headline: loraplex base decode at", "online (S-LoRA-style): 6 requests, Poisson",
                   "| system | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
                   "loraplex, 4 adapters / 4 slots", "loraplex, base model: steps "):
        assert needle in text, (needle, text)
    figures = json.loads(smoke_run.read_text())
    assert figures["smoke"] and figures["bandwidth"]["bytes_per_s"] > 0
    fixed = figures["workloads"]
    for name, spec in gpu.SMOKE_FIXED.items():
        r = fixed[name]
        systems = ["loraplex_adapters", "loraplex_base"] + (["transformers_batched", "peft_mixed"] if spec.peers else [])
        assert list(r["systems"]) == systems
        for key in systems:
            assert r["systems"][key]["tokens"] == spec.requests * spec.new_tokens
        for key in ("loraplex_adapters", "loraplex_base"):
            s = r["systems"][key]
            assert s["decode_tokens_per_s"] > 0 and 0 < s["roofline_fraction"]
        if spec.peers:  # float32 on CPU: the twins hold our weights, so greedy tokens match exactly
            assert r["identical"] == {"base_vs_transformers": [spec.requests] * 2,
                                      "adapters_vs_peft": [spec.requests] * 2}
            assert set(r["ratios"]) == {"adapters_vs_peft", "base_vs_transformers", "adapters_vs_base"}
        else:
            assert "identical" not in r and set(r["ratios"]) == {"adapters_vs_base"}
        assert r["roofline"]["adapters"]["bytes"]["adapters"] > 0 == r["roofline"]["base"]["bytes"]["adapters"]
    online = fixed["online"]
    assert [o["requests"] for o in online] == [6, 6, 6] and len({o["output_tokens"] for o in online}) == 1
    assert all(o["ttft_p50"] <= o["ttft_p99"] and o["tpot_p50"] > 0 for o in online)
    for o in online:  # every engine.step() counted once, by kind, within the run's time
        steps = o["steps"]
        assert set(steps) == {"launched", "run"} and steps["run"]["count"] >= 1  # prompts run at once
        assert 0 < sum(s["seconds"] for s in steps.values()) <= o["makespan_s"] + 1e-6


def test_online_repeats_take_turns_and_keep_each_systems_shortest_run(smoke_run, capsys):
    profiles = smoke_run.parent / "profiles"
    assert gpu.main(["--smoke", "--workloads", "online", "--repeats", "2", "--json", str(smoke_run),
                     "--profile", str(profiles)]) == 0
    names = sorted(p.name for p in profiles.iterdir())
    assert names == [f"online-{k}-{r}.pstats" for k in range(3) for r in range(2)]
    assert "run_online" in str(pstats.Stats(str(profiles / names[0])).stats)  # each holds its run's calls
    captured = capsys.readouterr()
    assert "best of 2 runs per system, taking turns" in captured.out
    runs = [line.split(": ")[1] for line in captured.err.splitlines() if line.startswith("  online: loraplex")]
    systems = ["loraplex, 4 adapters / 4 slots", "loraplex, one adapter", "loraplex, base model"]
    assert runs == systems + systems[1:] + systems[:1]  # each round starts with the next system
    timed = {}
    for line in captured.err.splitlines():
        if line.startswith("  online: loraplex"):
            label, seconds = line.removeprefix("  online: ").rsplit(": ", 1)
            timed.setdefault(label, []).append(float(seconds.removesuffix("s")))
    figures = json.loads(smoke_run.read_text())["workloads"]
    kept = figures["online"]
    assert [round(o["makespan_s"], 1) for o in kept] == [min(timed[label]) for label in systems]
    rounds = figures["online_rounds"]  # each round's tok/s per system, in the systems' order
    assert len(rounds) == 2 and all(len(r) == 3 for r in rounds)
    assert max(r[0] for r in rounds) == pytest.approx(kept[0]["tokens_per_s"])  # same tokens: best = fastest
    for k, other in ((1, systems[1]), (2, systems[2])):  # the paired ratios' line: each round's, and their median
        ratios = [r[0] / r[k] for r in rounds]
        line = f"{systems[0]} / {other}, round by round: {ratios[0]:.2f}, {ratios[1]:.2f} " \
               f"(median {statistics.median(ratios):.2f}x)"
        assert line in captured.out


def test_roofline_bytes_of_a_decode_step():
    loaded = gpu.build_model("135m", torch.device("cpu"), torch.float32, 2, smoke=True)  # tied head
    c, model = loaded.config, loaded.model
    params = sum(p.numel() for p in model.parameters()) * 4  # parameters() yields a tied tensor once
    assert roofline.weight_bytes_per_step(model, c, rows=3) == params
    untied = gpu.build_model("8b", torch.device("cpu"), torch.float32, 2, smoke=True)
    embed = untied.model.model.embed_tokens.weight
    full = sum(p.numel() for p in untied.model.parameters()) * 4
    rows_read = full - (embed.shape[0] - 3) * embed.shape[1] * 4  # an untied embedding: 3 rows read
    assert roofline.weight_bytes_per_step(untied.model, untied.config, rows=3) == rows_read
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert roofline.kv_bytes_per_token(c, torch.float32) == per_token
    step = roofline.decode_step_bytes(model, c, torch.float32, 3, 30.0)
    assert step.total == params + 30 * per_token
    bw = roofline.Bandwidth(copy_bytes=100, copy_seconds=1.0, sum_seconds=0.5, reps=1, method="perf_counter")
    assert bw.bytes_per_s == 200 and bw.read_side_bytes_per_s == 100
    assert roofline.roofline_tokens_per_s(3, step, bw) == pytest.approx(3 * 200 / step.total)
    assert roofline.average_decode_context(256, 64) == 288


def test_online_workload_is_seeded_skewed_and_timed():
    w = online_workload(100, rate=10.0, num_adapters=8, zipf_alpha=1.0, duration_s=None, num_requests=400,
                        prompt_lens=(3, 9), output_lens=(1, 4), special_ids=[0, 1], seed=3)
    assert w == online_workload(100, 10.0, 8, 1.0, None, 400, (3, 9), (1, 4), [0, 1], 3)
    assert w.num_requests == 400 and w.arrivals == sorted(w.arrivals)
    assert 25 < w.arrivals[-1] < 55  # 400 arrivals at 10/s
    counts = [w.adapter_ranks.count(k) for k in range(8)]
    assert counts[0] > 2 * counts[7]  # power law: the first adapter is the most popular
    assert all(3 <= len(p) <= 9 for p in w.prompts) and all(1 <= n <= 4 for n in w.max_new_tokens)
    by_time = online_workload(100, 10.0, 8, duration_s=5.0, seed=3)
    assert by_time.arrivals[-1] <= 5.0
    t = RequestTimes(arrival=1.0, first_token=1.5, finish=3.5, output_tokens=5)
    assert (t.ttft, t.tpot, t.e2e) == (0.5, 0.5, 2.5)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 100) == 4
