"""Start-up warm-up (engine/warm_up.py): made-up requests through the engine's own steps, leaving it as it was
found. On the GPU it also captures every decode graph (tests/gpu/test_gpu_decode_graphs.py)."""

import math

import pytest
import torch

from loraplex.engine.warm_up import WARM_UP_KEY
from loraplex.lora.adapter import LoraAdapter, LoraConfig
from loraplex.lora.weights import LoraWeights
from loraplex.params import SamplingParams

PROMPTS = [[1, 450, 3700, 17, 29], [9, 9, 1201, 55, 77, 300, 14]]


def adapter_over(base_shapes, seed: int = 5) -> LoraAdapter:
    """Rank 8 on every attention projection, large enough to change greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    modules = {name: LoraWeights(torch.randn(8, n_in, generator=g) / math.sqrt(n_in),
                                 torch.randn(n_out, 8, generator=g) * 2.0 / math.sqrt(8), 2.0)
               for name, (n_in, n_out) in sorted(base_shapes.items()) if name.endswith(("q_proj", "v_proj"))}
    return LoraAdapter("tenant", modules, LoraConfig(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj")))


def generate(engine, adapter) -> list[list[int]]:
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True), adapter=used)
                for p in PROMPTS for used in (adapter, None)]
    while engine.has_unfinished:
        engine.step()
    return [r.output_ids for r in requests]


def small_engine(make_engine, **config):
    return make_engine(max_batch_prefill_tokens=64, max_input_length=60, max_total_tokens=80, max_active_adapters=2,
                       max_lora_rank=16, **config)


def test_warm_up_leaves_the_engine_as_it_found_it(make_engine):
    engine = small_engine(make_engine)
    allocator, free = engine.scheduler.allocator, engine.scheduler.allocator.num_free
    steps: list[dict[str, int]] = []
    execute = engine.runner.execute

    def recording(scheduled, *args):
        steps.append({item.request.request_id: item.num_new_tokens for item in scheduled})
        return execute(scheduled, *args)

    engine.runner.execute = recording
    report = engine.warm_up()
    assert report.requests == 4 and report.graphs_captured == 0  # CPU: no graphs
    # The two long prompts overflow a step's prompt budget: one of them runs in two chunks (a resumed prompt).
    assert steps[0] == {"req-0": 48, "req-1": 16} and steps[1] == {"req-0": 1, "req-1": 32}
    assert not engine.has_unfinished and not engine.adapters.in_use
    assert engine.lora.occupant == [None, None] and engine.scheduler.slots.slot_of(WARM_UP_KEY) is None
    assert allocator.num_free == free and allocator.num_used == 0


def test_the_long_prompts_mix_two_adapters_in_one_step(make_engine):
    """Steps of several adapters' rows take the tile kernels on CUDA: compiled in the warm-up, not in the first step
    that mixes two users' adapters (which would stall every request in it)."""
    engine = small_engine(make_engine)
    adapters_per_step: list[set] = []
    execute = engine.runner.execute

    def recording(scheduled, *args):
        adapters_per_step.append({item.request.adapter_key for item in scheduled})
        return execute(scheduled, *args)

    engine.runner.execute = recording
    engine.warm_up()
    assert adapters_per_step[0] == {WARM_UP_KEY, WARM_UP_KEY + "-2"}
    assert engine.lora.occupant == [None, None]


def test_outputs_after_a_warm_up_equal_those_of_a_cold_engine(make_engine):
    cold = small_engine(make_engine)
    adapter = adapter_over(cold.lora.base_shapes)
    expected = generate(cold, adapter)
    assert expected[0] != expected[1] and expected[2] != expected[3]  # the adapter changes greedy tokens
    warm = small_engine(make_engine)
    warm.warm_up()
    assert generate(warm, adapter) == expected


def test_an_engine_without_adapter_slots_warms_up_on_the_base_model(make_engine):
    engine = small_engine(make_engine)
    engine.lora.num_slots = 0  # as a model with no adapter slots has
    assert engine.warm_up().requests == 3


@pytest.mark.parametrize("flag,expected", [([], None), (["--warm-up"], True), (["--no-warm-up"], False)])
def test_the_flag_reaches_the_config(flag, expected):
    from loraplex.cli import _engine_config, build_parser

    assert _engine_config(build_parser().parse_args(["serve", *flag])).warm_up is expected


def test_by_default_only_a_cuda_engine_warms_up(make_engine):
    assert not make_engine().warms_up  # the CPU: nothing to compile or capture
    assert make_engine(warm_up=True).warms_up


def test_loading_an_engine_warms_it_up_when_asked(monkeypatch):
    from loraplex import cli
    from loraplex.engine.engine import Engine

    calls, said = [], []
    monkeypatch.setattr(Engine, "from_config", classmethod(lambda cls, config, **kw: FakeEngine(config)))

    class FakeEngine:
        def __init__(self, config):
            self.warms_up = config.warm_up

        def warm_up(self):
            calls.append(True)
            from loraplex.engine.warm_up import WarmUpReport
            return WarmUpReport(7, 3, 0.5)

    for flag in ("--warm-up", "--no-warm-up"):
        cli._load_engine(cli.build_parser().parse_args(["serve", flag]), log=said.append)
    assert calls == [True] and said == ["warmed up: 7 made-up requests, 3 decode graphs captured, in 0.5s"]


def test_each_decode_size_runs_steps_of_exactly_that_many_rows_with_the_adapter_and_without(make_engine):
    """On CUDA the sizes are the graphs' buckets, so that each is captured over the adapter and without; on the CPU
    they are given, and the steps watched."""
    from loraplex.engine.warm_up import warm_up

    engine = small_engine(make_engine)
    decode_steps = set()
    schedule = engine.scheduler.schedule

    def watched():
        plan = schedule()
        if plan.scheduled and all(item.num_new_tokens == 1 for item in plan.scheduled):
            on_adapter = {item.request.adapter_key is not None for item in plan.scheduled}
            assert len(on_adapter) == 1, "a warm-up step mixed adapter rows and base rows"
            decode_steps.add((len(plan.scheduled), on_adapter.pop()))
        return plan

    engine.scheduler.schedule = watched
    sizes = [1, 2, 4, 6]
    report = warm_up(engine, decode_sizes=sizes)
    assert report.requests == 2 + 2 * sum(sizes)
    # (The long prompts decode a step apart, the second one chunked: their lone decode step is one of these.)
    assert decode_steps == {(rows, on) for rows in sizes for on in (True, False)}
    assert not engine.has_unfinished


def test_the_zero_adapter_targets_what_peft_all_linear_targets(make_engine):
    """Decode graphs are keyed by the layers the installed adapters target: the warm-up's are those of the most
    common broad adapter, every linear but the output head."""
    from loraplex.engine.warm_up import _zero_adapter

    engine = small_engine(make_engine)
    adapter = _zero_adapter(engine)
    assert set(adapter.modules) == {name for name in engine.lora.base_shapes if not name.endswith("lm_head")}
    assert {name.rsplit(".", 1)[-1] for name in adapter.modules} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter.max_rank == 16 and all(not w.a.any() and not w.b.any() for w in adapter.modules.values())
