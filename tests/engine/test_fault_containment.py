"""Fault containment on the embedded model: an adapter whose install raises, a request whose forward pass,
grammar mask or sampling raises fail only their own requests. Every other request's greedy (and seeded)
tokens equal its solo tokens, the engine keeps serving afterwards and every KV block is free at the end."""

from __future__ import annotations

import pathlib

import llguidance.torch
import pytest

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.lora.device.table import AdapterTable
from loraplex.lora.sources.store import AdapterStore
from loraplex.params import GrammarSpec, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
QUESTIONS = ("What is your name?", "Name a colour.", "Who made you?")
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, ignore_eos=True, do_sample=True, temperature=0.9, seed=7)
POISON_SEED = 666  # marks the request a fault is injected into (seeds reach the sampler and the runner)
POISONED = SamplingParams(max_new_tokens=6, ignore_eos=True, seed=POISON_SEED)


@pytest.fixture(scope="module")
def adapters(embedded):
    shapes = Engine(embedded, _config(max_batch_total_tokens=256)).lora.base_shapes
    store = AdapterStore(shapes, 64, roots=[ROOT], default_source="local")
    try:
        return {name: store.load(name) for name in ("name-nova", "name-lyra", "name-orion")}
    finally:
        store.close()


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", **kw)


@pytest.fixture(scope="module")
def prompts(embedded):
    tok = embedded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def jobs(prompts, adapters):
    """(prompt, params, adapter): greedy on the base model and two adapters, and one seeded sampled request."""
    nova, lyra = adapters["name-nova"], adapters["name-lyra"]
    return [(prompts[0], GREEDY, None), (prompts[1], GREEDY, None), (prompts[2], SEEDED, None),
            (prompts[0], GREEDY, nova), (prompts[1], GREEDY, nova), (prompts[2], GREEDY, lyra)]


def solo_tokens(engine: Engine, jobs) -> list[list[int]]:
    return [engine.generate([p], params, adapters=[a])[0].token_ids for p, params, a in jobs]


@pytest.fixture(scope="module")
def solo(embedded, jobs):
    return solo_tokens(Engine(embedded, _config(max_batch_total_tokens=2048)), jobs)


def run(engine: Engine, jobs) -> list:
    return run_requests(engine, jobs)[1]


def run_requests(engine: Engine, jobs) -> tuple[list, list]:
    """The requests for `jobs` and their final outputs, run to completion together."""
    requests = [engine.add_request(p, params, adapter=a) for p, params, a in jobs]
    finals = {}
    while engine.has_unfinished:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return requests, [finals[r.request_id] for r in requests]


def check_all_free(engine: Engine) -> None:
    scheduler = engine.scheduler
    assert not scheduler.has_unfinished and scheduler.allocator.num_used == 0
    assert scheduler.allocator.num_free == scheduler.config.num_blocks
    for slot, adapter_id in enumerate(scheduler.slots.occupant):  # every slot the scheduler counts is installed
        assert adapter_id is None or engine.lora.occupant[slot] == adapter_id


@pytest.mark.parametrize("when", ["before-writing", "after-writing"])
def test_an_adapter_whose_install_raises_fails_only_its_requests(make_engine, jobs, solo, adapters, prompts, monkeypatch, when):
    engine = make_engine(max_active_adapters=2)  # three adapters for two slots: the failed slot must be reusable
    orion = adapters["name-orion"]
    install = AdapterTable.install

    def failing_install(self, slot, adapter):
        if adapter.adapter_id == orion.adapter_id:
            if when == "after-writing":  # a failure half way: the slot's tables already hold its weights
                install(self, slot, adapter)
            raise RuntimeError("injected install failure")
        install(self, slot, adapter)

    monkeypatch.setattr(AdapterTable, "install", failing_install)
    bad = [(prompts[0], GREEDY, orion), (prompts[1], GREEDY, orion)]
    outs = run(engine, [*jobs, *bad])
    assert [o.token_ids for o in outs[: len(jobs)]] == solo
    for out in outs[len(jobs) :]:
        assert out.error is not None and "could not be installed: injected install failure" in out.error
    assert orion.adapter_id not in engine.lora.occupant and engine.scheduler.slots.slot_of(orion.adapter_id) is None
    check_all_free(engine)

    monkeypatch.setattr(AdapterTable, "install", install)  # the next request for it installs it again
    again = run(engine, [*bad, *jobs])
    assert [o.token_ids for o in again] == solo_tokens(make_engine(), bad) + solo
    check_all_free(engine)


def test_a_request_whose_sampling_raises_fails_alone(make_engine, jobs, solo, prompts, adapters, monkeypatch):
    engine = make_engine()
    sampler = engine.runner.logits.sampler
    calls = []

    def failing_sampler(logits, params, prompt_ids, output_ids, seeds):
        calls.append(len(seeds))
        if any(seed == POISON_SEED and len(out) >= 2 for seed, out in zip(seeds, output_ids)):  # mid-decode
            raise RuntimeError("injected sampler failure")
        return sampler(logits, params, prompt_ids, output_ids, seeds)

    monkeypatch.setattr(engine.runner.logits, "sampler", failing_sampler)
    bad = [(prompts[1], POISONED, None), (prompts[2], POISONED, adapters["name-nova"])]  # beside their own adapters
    outs = run(engine, [*jobs, *bad])
    assert [o.token_ids for o in outs[: len(jobs)]] == solo
    for out in outs[len(jobs) :]:
        assert out.error is not None and "sampling failed for this request: injected sampler failure" in out.error
    assert 1 in calls  # it was narrowed down to single requests
    check_all_free(engine)
    assert [o.token_ids for o in run(engine, jobs)] == solo


def test_a_request_whose_grammar_mask_raises_fails_alone(make_engine, jobs, solo, prompts, monkeypatch):
    engine = make_engine()
    regex = SamplingParams(max_new_tokens=6, grammar=GrammarSpec("regex", r"[a-z]{3,5} [0-9]{2}"))
    constrained = [(prompts[0], regex, None)]
    constrained_solo = solo_tokens(make_engine(), constrained)
    poisoned = []  # the matcher whose mask computation breaks
    batch, single = llguidance.torch.fill_next_token_bitmask_par, llguidance.torch.fill_next_token_bitmask

    def failing_batch(executor, work, bitmask):
        if any(matcher is m for matcher, _ in work for m in poisoned):
            raise RuntimeError("injected mask failure")
        return batch(executor, work, bitmask)

    def failing_single(matcher, bitmask, index=0):
        if any(matcher is m for m in poisoned):
            raise RuntimeError("injected mask failure")
        return single(matcher, bitmask, index)

    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask_par", failing_batch)
    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask", failing_single)
    requests = [engine.add_request(p, params, adapter=a) for p, params, a in [*jobs, *constrained, (prompts[1], regex, None)]]
    poisoned.append(requests[-1].grammar)
    finals = {}
    while engine.has_unfinished:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [finals[r.request_id] for r in requests]
    assert [o.token_ids for o in outs[:-1]] == solo + constrained_solo
    assert outs[-1].error is not None and "sampling failed for this request: injected mask failure" in outs[-1].error
    check_all_free(engine)
    assert [o.token_ids for o in run(engine, [*jobs, *constrained])] == solo + constrained_solo


def test_a_request_whose_forward_raises_fails_alone_and_its_readers_are_requeued(make_engine, jobs, solo, prompts, monkeypatch):
    """A fault in the runner for one request (retried in halves until it is alone). The chat prompts share their
    first KV blocks (the template's system prompt): a reader of a failing writer's blocks is recomputed, not failed."""
    engine = make_engine()
    execute = engine.runner.execute
    runs = []

    def failing_execute(scheduled, *args):
        runs.append(len(scheduled))
        if any(item.request.seed == POISON_SEED for item in scheduled):
            raise RuntimeError("injected forward failure")
        return execute(scheduled, *args)

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    # The poisoned request first: it writes the system prompt's blocks that the base requests after it read.
    writer = (prompts[2], POISONED, None)
    requests, outs = run_requests(engine, [writer, *jobs])
    assert outs[0].error is not None and "(the base model): injected forward failure" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == solo
    assert [r.num_preemptions for r in requests[1:]] == [1, 1, 1, 0, 0, 0]  # the base model's readers: requeued
    assert min(runs) == 1  # narrowed down to the failing request alone
    check_all_free(engine)
    # Last (a reader): it fails alone at once, decoding or not.
    outs = run(engine, [*jobs, writer])
    assert [o.token_ids for o in outs[:-1]] == solo and outs[-1].error is not None
    check_all_free(engine)
