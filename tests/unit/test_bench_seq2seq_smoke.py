"""Smoke test of the encoder-decoder benchmark (benchmarks/seq2seq.py) at tiny sizes: random T5 and BART built,
saved and loaded through loraplex's loader, every system run (loraplex, transformers batched and one at a time,
loraplex with PEFT-saved adapters, PEFT's mixed-adapter batch). Token counts, greedy-token identity and the
ratios' arithmetic are checked; no speed is asserted."""

from __future__ import annotations

import types

import pytest

from benchmarks import systems
from benchmarks.seq2seq import (
    FAMILY_TOKENS,
    ModelSize,
    bench_seq2seq,
    format_seq2seq,
    seq2seq_workload,
    setup_family,
)

SIZE = ModelSize(d_model=64, layers=2, heads=4, d_ff=128, vocab_size=512)
ARGS = types.SimpleNamespace(requests=4, one_at_a_time_requests=2, repeats=1, adapters=2, adapter_rank=4, seed=0,
                             input_lens=(4, 30), new_tokens_range=(2, 8))


@pytest.fixture(scope="module", params=["t5", "bart"])
def setup(request, tmp_path_factory):
    return setup_family(request.param, ARGS, tmp_path_factory.mktemp(request.param), SIZE)


def test_workload_is_deterministic_wrapped_and_avoids_special_ids():
    bart = FAMILY_TOKENS["bart"]
    w = seq2seq_workload(16, 100, bart, input_lens=(3, 12), new_tokens=(1, 5), seed=4)
    assert w == seq2seq_workload(16, 100, bart, input_lens=(3, 12), new_tokens=(1, 5), seed=4)
    assert all(p[0] == 0 and p[-1] == 2 and 3 <= len(p) <= 12 for p in w.prompts)
    assert {t for p in w.prompts for t in p[1:-1]} <= set(range(4, 100))
    assert all(1 <= n <= 5 for n in w.max_new_tokens)
    t5 = seq2seq_workload(8, 100, FAMILY_TOKENS["t5"], input_lens=(2, 6), seed=4)
    assert all(p[-1] == 1 and 1 not in p[:-1] and 0 not in p for p in t5.prompts)


def test_every_system_gives_the_requested_tokens_and_loraplex_matches_transformers(setup):
    result = bench_seq2seq(setup, one_at_a_time_requests=ARGS.one_at_a_time_requests)
    w = setup.workload
    assert len(set(w.max_new_tokens)) > 1 and len({len(p) for p in w.prompts}) > 1  # mixed lengths
    assert result.ours.tokens == result.batched.tokens == result.adapters.tokens == result.peft.tokens == w.new_tokens
    assert result.one_at_a_time.tokens == sum(w.max_new_tokens[:2]) and result.one_at_a_time.requests == 2
    assert result.identical_batched == 4 and result.identical_one == 2  # float32, tiny: every token equal
    assert result.identical_peft == 4  # loraplex with PEFT-saved adapters gives PEFT's mixed batch's tokens
    assert result.differ_from_base >= 1  # the adapters change the output
    assert result.stats["max_running"] == 4  # all requests at once
    assert setup.adapter_workload.num_adapters == 2
    text = format_seq2seq(result, "cpu float32, 1 threads")
    for needle in (f"workload seq2seq ({setup.family}: random", "encoder input /", "transformers batched",
                   "transformers one-at-a-time", "loraplex, 2 adapters", "PEFT mixed-adapter batch",
                   "target >= 1.5x", "target >= 5.0x", "for 4/4 requests, to transformers one-at-a-time for 2/2",
                   "4/4 requests identical to PEFT's", "load average"):
        assert needle in text, (needle, text)
    figures = result.to_json()
    assert figures["identical_to_batched"] == [4, 4] and figures["identical_to_peft"] == [4, 4]
    assert set(figures["ratios"]) == {"batched", "one_at_a_time", "peft_mixed", "adapters_vs_base"}


def test_ratios_and_best_of_repeats_from_measured_times(setup, monkeypatch):
    # A fake clock, two rounds; each system keeps its best: loraplex 1 s, batched 2 s, one-at-a-time 4 s,
    # loraplex with adapters 1.25 s, PEFT 5 s.
    first = [3.0, 2.0, 4.0, 1.25, 6.0]
    second = [1.0, 3.0, 5.0, 2.0, 5.0]
    ticks = iter([t for d in first + second for t in (0.0, d)])
    monkeypatch.setattr(systems, "perf_counter", lambda: next(ticks))
    result = bench_seq2seq(setup, one_at_a_time_requests=2, repeats=2)
    w = setup.workload
    assert (result.ours.seconds, result.batched.seconds, result.one_at_a_time.seconds,
            result.adapters.seconds, result.peft.seconds) == (1.0, 2.0, 4.0, 1.25, 5.0)
    ratios = result.ratios
    assert ratios["batched"] == pytest.approx(2.0)
    assert ratios["one_at_a_time"] == pytest.approx(w.new_tokens / (sum(w.max_new_tokens[:2]) / 4.0))
    assert ratios["peft_mixed"] == pytest.approx(4.0) and ratios["adapters_vs_base"] == pytest.approx(0.8)
    text = format_seq2seq(result, "cpu float32, 1 threads")
    assert "best of 2" in text and "loraplex = 2.00x (target >= 1.5x, met)" in text
    assert "loraplex with adapters = 4.00x (target >= 1.5x, met)" in text


def test_the_cli_offers_the_seq2seq_workload(capsys):
    from loraplex.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--workload", "seq2seq", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "seq2seq" in help_text and "--family {t5,bart,both}" in help_text
