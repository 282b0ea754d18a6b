"""A hostile adapter cannot change or fail anyone else's request, on the embedded model with the shipped
adapters: 20 greedy requests (4 questions x the 4 shipped adapters and the base) run beside poisoned
adapters and equal their solo outputs, during and after, in the segmented and in the stacked LoRA
form. The poison is put into adapters past the load-time checks (built in memory, or installed into a
slot mid-flight), so what is proved here is the arithmetic's and the engine's isolation."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.lora.adapter import AdapterInvalid, LoraAdapter, LoraWeights, check_weights
from loraplex.lora.merge import merge_adapters
from loraplex.lora.sources.store import AdapterStore
from loraplex.params import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
SHIPPED = ("name-nova", "name-orion", "name-lyra", "style-caps")
QUESTIONS = ("What is your name?", "What is the capital of France?", "Name a colour.", "Who made you?")
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)
MODULE = "model.layers.3.self_attn.q_proj"
FORMS = {"segments": 0, "stacked": 10**6}  # the runner's rows-per-segment threshold for the stacked form


@pytest.fixture(scope="module")
def shipped(embedded) -> dict[str, LoraAdapter]:
    shapes = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=256)).lora.base_shapes
    store = AdapterStore(shapes, 64, roots=[ROOT], default_source="local")
    try:
        return {name: store.load(name) for name in SHIPPED}
    finally:
        store.close()


@pytest.fixture(scope="module")
def prompts(embedded) -> list[list[int]]:
    tok = embedded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def good_jobs(shipped, prompts) -> list[tuple[list[int], LoraAdapter | None]]:
    return [(prompt, adapter) for adapter in [*shipped.values(), None] for prompt in prompts]


@pytest.fixture(scope="module")
def solo(embedded, good_jobs) -> list[list[int]]:
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=1024, max_active_adapters=1))
    outs = [engine.generate([p], PARAMS, adapters=[a])[0].token_ids for p, a in good_jobs]
    assert len({tuple(o) for o in outs}) > len(good_jobs) // 2, "adapters must change the outputs for this to mean much"
    return outs


def corrupted(adapter: LoraAdapter, name: str, part: str, value: float, everywhere: bool = False) -> LoraAdapter:
    """A copy of `adapter` under `name` with `value` put into one module's `part` (a, b or scale)."""
    modules = dict(adapter.modules)
    weights = modules[MODULE]
    if part == "scale":
        modules[MODULE] = dataclasses.replace(weights, scale=value)
    else:
        tensor = getattr(weights, part).clone()
        if everywhere:
            tensor.fill_(value)
        else:
            tensor[0, 0] = value
        modules[MODULE] = dataclasses.replace(weights, **{part: tensor})
    return LoraAdapter(name, modules, adapter.config)


@pytest.fixture(scope="module")
def poisoned(shipped) -> dict[str, LoraAdapter]:
    nova = shipped["name-nova"]
    huge = corrupted(nova, "huge-b", "b", 500.0, everywhere=True)  # within the bounds: it passes the load check
    check_weights(MODULE, huge.modules[MODULE])
    return {
        "nan-b": corrupted(nova, "nan-b", "b", math.nan),
        "inf-b": corrupted(nova, "inf-b", "b", math.inf),
        "neg-inf-a": corrupted(nova, "neg-inf-a", "a", -math.inf),
        "nan-scale": corrupted(nova, "nan-scale", "scale", math.nan),
        "huge-b": huge,
        "merge-with-huge": merge_adapters("merge-with-huge", [nova, huge], [0.5, 0.5]),
    }


def test_merges_with_a_non_finite_adapter_are_refused(shipped, poisoned):
    for name in ("nan-b", "inf-b", "neg-inf-a"):
        with pytest.raises(AdapterInvalid, match="NaN or infinite"):
            merge_adapters("m", [shipped["name-lyra"], poisoned[name]], [0.5, 0.5])


@pytest.mark.parametrize("form, overlap", [("segments", False), ("stacked", False), ("segments", True)])
def test_poisoned_adapters_change_no_other_request_during_or_after(embedded, good_jobs, solo, shipped, poisoned, form,
                                                                  overlap):
    """With overlapped steps (engine/worker/overlap.py) the late poison fails its requests when a launched step is read."""
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096, max_active_adapters=12,
                                           overlap_steps=overlap))
    engine.runner.lora_planner.stacked_rows_per_segment = FORMS[form]
    stacked_steps = count_stacked_steps(engine)
    prompt = good_jobs[0][0]
    nova = shipped["name-nova"]

    good = [engine.add_request(p, PARAMS, adapter=a) for p, a in good_jobs]
    bad = {name: engine.add_request(prompt, PARAMS, adapter=adapter) for name, adapter in poisoned.items()}
    # Two more start clean and are poisoned in their slots mid-flight: decode steps then carry the poison.
    late = {name: engine.add_request(prompt, PARAMS, adapter=dataclasses.replace(nova, adapter_id=name))
            for name in ("late-nan-b", "late-inf-a")}
    finals = {}
    for step in range(100):
        if step == 2:
            engine.lora.install(late["late-nan-b"].adapter_slot, corrupted(nova, "late-nan-b", "b", math.nan))
            engine.lora.install(late["late-inf-a"].adapter_slot, corrupted(nova, "late-inf-a", "a", math.inf))
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished:
            break

    assert [finals[r.request_id].token_ids for r in good] == solo
    failed = {name for name, r in {**bad, **late}.items() if finals[r.request_id].error is not None}
    # The poison bit its own requests: each non-finite one was stopped (the huge ones may or may not be).
    assert failed >= {"nan-b", "inf-b", "neg-inf-a", "nan-scale", "late-nan-b", "late-inf-a"}
    assert "non-finite" in finals[bad["nan-b"].request_id].error
    if form == "stacked":
        assert stacked_steps[0] >= PARAMS.max_new_tokens - 2  # the decode steps did run stacked

    # After: poisoned requests' KV blocks (NaN from the poisoned layer on) go straight to the next
    # requests (freed blocks are reused first); nothing of theirs may reach the new owners.
    assert engine.scheduler.allocator.num_used == 0
    gone = engine.generate([prompt, good_jobs[1][0]], PARAMS, adapters=[poisoned["nan-b"], poisoned["neg-inf-a"]])
    assert all(o.error is not None for o in gone)
    again = engine.generate([p for p, _ in good_jobs], PARAMS, adapters=[a for _, a in good_jobs])
    assert [o.token_ids for o in again] == solo


def test_an_adapter_whose_computation_raises_fails_only_its_own_requests(embedded, good_jobs, solo, shipped):
    """A failure inside one adapter's arithmetic (here a factor of the wrong shape, installed past the
    checks): the step is retried without it, so only that adapter's requests fail."""
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096, max_active_adapters=8))
    nova = shipped["name-nova"]
    broken = LoraAdapter("broken", {**nova.modules, MODULE: LoraWeights(torch.zeros(8, 3), torch.zeros(576, 8), 2.0)},
                         nova.config)
    for form, threshold in FORMS.items():
        engine.runner.lora_planner.stacked_rows_per_segment = threshold
        jobs = [*good_jobs, (good_jobs[0][0], broken), (good_jobs[1][0], broken)]
        outs = engine.generate([p for p, _ in jobs], PARAMS, adapters=[a for _, a in jobs])
        assert [o.token_ids for o in outs[:-2]] == solo, form
        assert all(o.error is not None and "(adapter 'broken')" in o.error for o in outs[-2:]), form
        assert engine.scheduler.allocator.num_used == 0


def count_stacked_steps(engine: Engine) -> list[int]:
    """How many of the engine's steps used the stacked LoRA form (read from the runner's LoRA plans)."""
    counter = [0]
    planner = engine.runner.lora_planner
    plan = planner.plan

    def counted(*args):
        rows = plan(*args)
        counter[0] += rows is not None and rows.stack is not None
        return rows

    planner.plan = counted
    return counter
