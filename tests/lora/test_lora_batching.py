"""Multi-LoRA batching on a tiny random Llama: heterogeneous batches, slot pressure, preemption.

Every request's greedy output must equal the same request served alone. Each engine is instrumented:
at every step the rows of each adapter's segments must be exactly its requests' rows (base-model rows
in none), each scheduled request's slot must hold its own adapter, at most `max_active_adapters`
distinct adapters run, and an install must never replace an adapter that a running request uses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from loraplex.engine.engine import Engine
from loraplex.layers.forward_context import current_lora
from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.params import SamplingParams
from tests.helpers import engine_for, ours_from_hf, tiny_hf_model

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# (rank, target modules) per adapter; some reach the output head (lm_head rows are the sampled rows).
SPECS = [
    (4, ("q_proj", "v_proj")),
    (8, ATTN),
    (16, MLP),
    (4, ("lm_head",)),
    (8, ("o_proj", "down_proj", "lm_head")),
    (16, ATTN + MLP),
    (4, ("k_proj", "up_proj")),
    (8, ("gate_proj", "lm_head", "v_proj")),
    (16, ("q_proj",)),
    (4, ATTN + MLP + ("lm_head",)),
    (8, ("up_proj",)),
    (16, ("v_proj", "o_proj")),
]


class FakeClock:
    """The slots' clock: one second per engine step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 1.0


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The shared 2-core CI box: intra-op threads only fight each other on a model this small."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    model, config = ours_from_hf(tiny_hf_model("llama", seed=3))
    return model, config


def make_adapter(base_shapes, adapter_id: str, rank: int, targets: tuple[str, ...], seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for name, (fan_in, fan_out) in sorted(base_shapes.items()):
        if name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, rank, generator=gen) * 0.6 / math.sqrt(rank)
            modules[name] = LoraWeights(a, b, scale=1.5)
    assert modules
    return LoraAdapter(adapter_id, modules, LoraConfig(r=rank, lora_alpha=1.5 * rank, target_modules=targets))


@pytest.fixture(scope="module")
def adapters(tiny):
    shapes = engine_for(*tiny, max_active_adapters=1).lora.base_shapes
    return [make_adapter(shapes, f"lora-{i}", rank, targets, seed=100 + i) for i, (rank, targets) in enumerate(SPECS)]


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_new_tokens: int
    adapter: LoraAdapter | None

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True)

    @property
    def key(self):
        return self.prompt, self.max_new_tokens, self.adapter.adapter_id if self.adapter else None


def workload(adapters: list[LoraAdapter | None], n: int, seed: int, max_prompt: int = 60, max_new: int = 14) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = tuple(rng.randrange(256) for _ in range(rng.randint(3, max_prompt)))
        jobs.append(Job(prompt, rng.randint(1, max_new), adapters[i % len(adapters)]))
    rng.shuffle(jobs)
    return jobs


@pytest.fixture(scope="module")
def solo(tiny):
    """Each job served alone (one at a time on an engine of its own), memoised across tests."""
    engine = engine_for(*tiny, max_active_adapters=len(SPECS))
    memo: dict = {}

    def run(jobs: list[Job]) -> list[list[int]]:
        for job in jobs:
            if job.key not in memo:
                adapters = [job.adapter] if job.adapter else None
                memo[job.key] = engine.generate([list(job.prompt)], job.params, adapters=adapters)[0].token_ids
        return [memo[job.key] for job in jobs]

    return run


class Probe:
    """Checks, at every step of `engine`, how its rows meet its adapters; counts what happened."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps = 0
        self.max_distinct = 0
        self.installs: list[tuple[int, str]] = []
        self.mixed_steps = 0  # steps with both prefill (chunk) rows and decode rows
        self.chunked = 0  # prefill steps that covered only part of a prompt
        self.lora_steps = 0
        self.forwards_without_lora = 0
        self._expect_tokens: dict[int, int] = {}
        self._expect_logits: dict[int, int] = {}
        self._active = False  # the model (and so the hooked layers) is shared with other engines
        self._wrap_install()
        self._wrap_execute()
        layers = engine.lora.layers
        self._hooks = [
            layers["model.layers.0.self_attn.q_proj"].register_forward_pre_hook(self._tokens_hook),
            layers["lm_head"].register_forward_pre_hook(self._logits_hook),
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _wrap_install(self) -> None:
        install = self.engine.lora.install

        def checked(slot: int, adapter: LoraAdapter) -> None:
            users = [r.request_id for r in self.engine.scheduler.running
                     if r.adapter_slot == slot and r.adapter_key != adapter.adapter_id]
            assert not users, f"installing {adapter.adapter_id} in slot {slot} under running {users}"
            self.installs.append((slot, adapter.adapter_id))
            install(slot, adapter)

        self.engine.lora.install = checked

    def _wrap_execute(self) -> None:
        runner, engine = self.engine.runner, self.engine
        execute = runner.execute

        def checked(scheduled, *args):
            self.steps += 1
            tokens: dict[int, int] = {}
            logits: dict[int, int] = {}
            kinds = set()
            for item in scheduled:
                r = item.request
                kinds.add("decode" if item.num_new_tokens == 1 and r.num_computed_tokens >= len(r.prompt_ids) else "prefill")
                if r.num_computed_tokens < len(r.prompt_ids) and not item.completes_sequence:
                    self.chunked += 1
                if r.adapter_key is None:
                    assert r.adapter_slot is None
                    continue
                assert engine.lora.occupant[r.adapter_slot] == r.adapter_key, "a request runs on another adapter's slot"
                tokens[r.adapter_slot] = tokens.get(r.adapter_slot, 0) + item.num_new_tokens
                if item.completes_sequence:
                    logits[r.adapter_slot] = logits.get(r.adapter_slot, 0) + 1
            self.mixed_steps += kinds == {"decode", "prefill"}
            distinct = {item.request.adapter_key for item in scheduled} - {None}
            assert len(distinct) <= engine.config.max_active_adapters
            self.max_distinct = max(self.max_distinct, len(distinct))
            self._expect_tokens, self._expect_logits = tokens, logits
            self._active = True
            try:
                return execute(scheduled, *args)
            finally:
                self._active = False

        runner.execute = checked

    @staticmethod
    def _per_slot(segments) -> dict[int, int]:
        counts: dict[int, int] = {}
        covered: set[int] = set()
        for seg in segments:
            rows = set(range(seg.start, seg.end))
            assert rows and not rows & covered, "empty or overlapping LoRA segments"
            covered |= rows
            counts[seg.slot] = counts.get(seg.slot, 0) + len(rows)
        return counts

    def _tokens_hook(self, module, args) -> None:
        if not self._active:
            return
        rows = current_lora()
        if not self._expect_tokens:
            assert rows is None, "a step without adapter requests built LoRA rows"
            self.forwards_without_lora += 1
            return
        self.lora_steps += 1
        assert self._per_slot(rows.tokens) == self._expect_tokens
        assert max(seg.end for seg in rows.tokens) <= args[0].shape[0]

    def _logits_hook(self, module, args) -> None:
        if not self._active:
            return
        rows = current_lora()
        if not self._expect_tokens:
            assert rows is None
            return
        assert self._per_slot(rows.logits) == self._expect_logits
        assert max(seg.end for seg in rows.logits) <= args[0].shape[0]


@pytest.fixture
def make_probe():
    made: list[Probe] = []

    def make(engine: Engine) -> Probe:
        made.append(Probe(engine))
        return made[-1]

    yield make
    for p in made:
        p.close()


def run_all(engine: Engine, jobs: list[Job], on_step=None, requests_out: list | None = None) -> list[list[int]]:
    requests = [
        engine.add_request(list(job.prompt), job.params, adapter=job.adapter) for job in jobs
    ]
    if requests_out is not None:
        requests_out.extend(requests)
    finals: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        if on_step is not None:
            on_step()
        steps += 1
        assert steps < 5000
    assert engine.scheduler.allocator.num_used == 0
    assert all(engine.scheduler.slots.pins(a) == 0 for a in engine.scheduler.slots.active)
    return [finals[r.request_id] for r in requests]


def assert_adapters_matter(jobs: list[Job], outputs: list[list[int]], solo) -> None:
    """The adapters visibly change greedy outputs, so serving the wrong one (or none) would show."""
    base = solo([Job(job.prompt, job.max_new_tokens, None) for job in jobs])
    with_adapter = [(job, out, b) for job, out, b in zip(jobs, outputs, base) if job.adapter is not None]
    differ = [job.adapter.adapter_id for job, out, b in with_adapter if out != b]
    assert len(differ) >= 0.8 * len(with_adapter), f"only {len(differ)}/{len(with_adapter)} differ from base"
    assert set(differ) == {job.adapter.adapter_id for job, _, _ in with_adapter}


@pytest.mark.parametrize("prefill_budget", [4096, 16], ids=["whole-prefill", "chunked-prefill"])
def test_heterogeneous_batch_equals_each_request_alone(tiny, adapters, solo, make_probe, prefill_budget):
    eight = adapters[:8]
    jobs = workload([*eight, None], n=32, seed=1)
    engine = engine_for(*tiny, max_active_adapters=8, max_batch_prefill_tokens=prefill_budget)
    probe = make_probe(engine)
    together = run_all(engine, jobs)
    assert together == solo(jobs)
    assert [len(t) for t in together] == [job.max_new_tokens for job in jobs]
    assert_adapters_matter(jobs, together, solo)
    assert sorted(a for _, a in probe.installs) == sorted(a.adapter_id for a in eight)  # 8 slots: no eviction
    if prefill_budget == 16:  # prompts span several steps, their chunks beside other requests' decode rows
        assert probe.chunked > 10 and probe.mixed_steps > 10 and probe.max_distinct >= 4
    else:
        assert probe.max_distinct == 8


def test_more_adapters_than_slots_rotate_and_still_match_alone(tiny, adapters, solo, make_probe):
    jobs = workload(adapters, n=40, seed=2, max_prompt=30, max_new=10) + workload([None], n=4, seed=3)
    engine = engine_for(*tiny, max_active_adapters=4, adapter_cycle_time_s=3.0)
    clock = FakeClock()
    engine.scheduler.slots.clock = clock
    probe = make_probe(engine)
    together = run_all(engine, jobs, on_step=clock.tick)
    assert together == solo(jobs)
    assert_adapters_matter(jobs, together, solo)
    assert probe.max_distinct == 4
    # Slots were reused: 12 adapters through 4 slots means evictions.
    assert len(probe.installs) >= len(adapters) and {a for _, a in probe.installs} == {a.adapter_id for a in adapters}


def test_preemption_with_adapters_resumes_exactly(tiny, adapters, solo, make_probe):
    # 8 blocks of 16 tokens; requests of up to ~30 prompt + 40 new tokens outgrow it while decoding.
    rng = random.Random(4)
    six = adapters[:6]
    jobs = [
        Job(tuple(rng.randrange(256) for _ in range(rng.randint(5, 30))), rng.randint(25, 40), [*six, None][i % 7])
        for i in range(14)
    ]
    engine = engine_for(*tiny, max_active_adapters=3, max_batch_total_tokens=128, adapter_cycle_time_s=2.0)
    clock = FakeClock()
    engine.scheduler.slots.clock = clock
    probe = make_probe(engine)
    requests = []
    together = run_all(engine, jobs, on_step=clock.tick, requests_out=requests)
    assert together == solo(jobs)
    preempted = [r for r in requests if r.num_preemptions]
    assert len(preempted) >= 3 and {r.adapter_key for r in preempted} - {None}, "the cache was meant to be too small"
    assert_adapters_matter(jobs, together, solo)
    assert probe.max_distinct == 3


def test_base_only_steps_build_no_lora_rows(tiny, adapters, solo, make_probe):
    engine = engine_for(*tiny, max_active_adapters=4)
    probe = make_probe(engine)
    warm = workload(adapters[:4], n=8, seed=5, max_prompt=20, max_new=4)
    assert run_all(engine, warm) == solo(warm)
    assert set(engine.lora.occupant) == {a.adapter_id for a in adapters[:4]}
    # Every slot holds an adapter now; a batch of base-model requests must not touch any of them.
    lora_steps = probe.lora_steps
    jobs = workload([None], n=12, seed=6)
    never_saw_an_adapter = engine_for(*tiny, max_active_adapters=1)
    assert run_all(engine, jobs) == run_all(never_saw_an_adapter, jobs) == solo(jobs)
    assert probe.lora_steps == lora_steps and probe.forwards_without_lora > 0
    # And beside adapter requests, base rows stay outside every segment (Probe checks the counts).
    mixed = workload([None, adapters[0], None, adapters[5]], n=12, seed=7)
    assert run_all(engine, mixed) == solo(mixed)
