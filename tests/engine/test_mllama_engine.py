"""Mllama through the engine with adapters: LoRA on the text layers, the cross-attention layers (their k/v
read image states, which take their request's adapter), lm_head and the vision encoder match PEFT; mixed
adapters, the base model, image and text-only requests share steps; and 24 requests arriving and finishing
at different steps, with chunked prefill and preemption, each give what they give alone (the test a padded
batch's filter/concatenate of a request-to-image map would fail)."""

from __future__ import annotations

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import engine_for
from tests.lora.peft_helpers import relayout_adapter, save_and_load
from tests.mllama_fixtures import ADAPTER_TARGETS, hf_greedy, mllama_peft_adapter, pictures, request_inputs, tiny_pair


NEW = 5
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
PROMPTS = [  # (text, image sizes)
    ("<|image|>w1 w2 w3 w40", [(30, 60)]),
    ("w4 w5 w90 <|image|>w6 w7", [(33, 31)]),
    ("w8 w9 w10 w100 w3", []),
    ("w1 <|image|>w2 w3 <|image|> w9 w12", [(30, 30), (60, 30)]),
]
# The fixture's named target sets, and the projector (one Linear, fed whole images).
TARGETS = {**ADAPTER_TARGETS, "projector": r"model\.multi_modal_projector"}
LORA_CASES = ("text", "cross", "vision", "projector", "lm_head", "all")


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("mllama"))


@pytest.fixture(scope="module")
def cases(mllama):
    """Per prompt: (text, pictures, token ids, engine image inputs)."""
    processor = mllama[1]
    out = []
    for seed, (text, sizes) in enumerate(PROMPTS):
        images = pictures(sizes, seed)
        out.append((text, images, *request_inputs(processor, text, images)))
    return out


@pytest.fixture(scope="module")
def adapters(mllama, cases, tmp_path_factory):
    """Per target set: our adapter read from PEFT's files, and PEFT's greedy tokens for every prompt."""
    hf, processor, model, config = mllama
    shapes = engine_for(model, config, max_active_adapters=1).lora.base_shapes
    out = {}
    for seed, name in enumerate(LORA_CASES):
        # The fixture's projector weights are scaled up (so images matter): its delta must be as large.
        peft = mllama_peft_adapter(hf, TARGETS[name], seed=seed + 1, strength=8.0 if name == "projector" else 0.5)
        adapter = save_and_load(peft, tmp_path_factory.mktemp(name), name, shapes,
                                base_weight=lambda m: model.get_submodule(m).weight)
        out[name] = (adapter, [hf_greedy(peft, processor, text, images, NEW, meta_masking=True)
                               for text, images, _, _ in cases])
    return out


@pytest.fixture(scope="module")
def base_tokens(mllama, cases):
    hf, processor = mllama[:2]
    return [hf_greedy(hf, processor, text, images, NEW, meta_masking=True) for text, images, _, _ in cases]


def run(engine, jobs, adapters=None, params=PARAMS):
    """jobs: (token ids, image inputs); all queued at once, run to the end."""
    adapters = adapters or [None] * len(jobs)
    requests = [engine.add_request(ids, params, adapter=a, images=i) for (ids, i), a in zip(jobs, adapters)]
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finals[out.request_id] = out.token_ids
    scheduler = engine.scheduler
    assert scheduler.allocator.num_used == 0 and scheduler.state_allocator.num_used == 0  # every block returned
    return [finals[r.request_id] for r in requests]


def test_adapter_module_kinds(mllama, adapters):
    from loraplex.lora.step.layers import row_kind
    from loraplex.models.mllama import MllamaForConditionalGeneration

    adapter, _ = adapters["all"]
    kinds = {name: row_kind(name, MllamaForConditionalGeneration.linear_rows) for name in adapter.modules}
    assert kinds["model.language_model.layers.1.cross_attn.k_proj"] == "states"
    assert kinds["model.language_model.layers.1.cross_attn.q_proj"] == "tokens"
    assert kinds["model.vision_model.global_transformer.layers.0.mlp.fc2"] == "patches"
    assert kinds["lm_head"] == "logits"
    assert len(adapter.modules) == 48


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_matches_peft(mllama, cases, adapters, base_tokens, case):
    _, _, model, config = mllama
    adapter, want = adapters[case]
    engine = engine_for(model, config, max_active_adapters=2)
    got = run(engine, [(ids, i) for _, _, ids, i in cases], [adapter] * len(cases))
    assert got == want
    with_images = [k for k, (_, images, _, _) in enumerate(cases) if images]
    assert any(got[k] != base_tokens[k] for k in with_images), f"{case} changes no image request: proves nothing"
    if case in ("cross", "vision", "projector"):  # image paths only: the text-only request is the base model's
        assert all(got[k] == base_tokens[k] for k in range(len(cases)) if k not in with_images)


def test_mixed_adapters_base_images_and_text_in_one_batch(mllama, cases, adapters, base_tokens):
    """Every prompt under every adapter and the base model in one batch, in both LoRA forms."""
    _, _, model, config = mllama
    variants = [None, *(adapter for adapter, _ in adapters.values())]
    expected = [base_tokens, *(want for _, want in adapters.values())]
    jobs = [((ids, i), v, e[k]) for k, (_, _, ids, i) in enumerate(cases) for v, e in zip(variants, expected)]
    for form, threshold in (("segments", 0), ("stacked", 10**6)):
        engine = engine_for(model, config, max_active_adapters=len(variants))
        engine.runner.lora_planner.stacked_rows_per_segment = threshold
        assert run(engine, [j for j, _, _ in jobs], [v for _, v, _ in jobs]) == [e for _, _, e in jobs], form


def test_batch_churn_with_chunked_prefill_and_preemption(mllama, adapters):
    """24 requests (images and text-only, three adapters and the base model) arriving over several steps,
    with chunked prefill and a KV budget small enough to preempt: each output equals that request alone."""
    _, processor, model, config = mllama
    texts = ["<|image|>w{a} w{b} w{c}", "w{a} w{b} <|image|>w{c} w7 w8 w9 w10", "w{a} w{b} w{c} w11 w12",
             "w{a} <|image|>w{b} <|image|>w{c}"]
    sizes = [[(30, 60)], [(33, 31)], [], [(30, 30), (60, 30)]]
    variants = [None, adapters["all"][0], adapters["cross"][0], adapters["vision"][0]]
    jobs = []
    for k in range(24):
        form = k % 4
        text = texts[form].format(a=k + 1, b=2 * k + 3, c=3 * k + 5)
        jobs.append((request_inputs(processor, text, pictures(sizes[form], seed=k)), variants[(k // 4) % 4]))
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    solo_engine = engine_for(model, config, max_active_adapters=4)
    alone = [run(solo_engine, [job], [adapter], params)[0] for job, adapter in jobs]

    engine = engine_for(model, config, max_active_adapters=4, max_batch_total_tokens=112, max_batch_prefill_tokens=6)
    preempted, chunked = [], []
    schedule = engine.scheduler.schedule

    def watched():
        plan = schedule()
        preempted.extend(plan.preempted)
        chunked.extend(s.request for s in plan.scheduled
                       if 1 < s.num_new_tokens and s.request.num_computed_tokens + s.num_new_tokens < len(s.request.prompt_ids))
        return plan

    engine.scheduler.schedule = watched
    requests, finals, pending, step = [], {}, list(jobs), 0
    while pending or engine.has_unfinished:
        if pending and step % 2 == 0:  # three new requests every other step
            for (ids, images), adapter in pending[:3]:
                requests.append(engine.add_request(ids, params, adapter=adapter, images=images))
            pending = pending[3:]
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finals[out.request_id] = out.token_ids
        step += 1
    assert [finals[r.request_id] for r in requests] == alone
    assert any(r.images is not None for r in preempted), "no image request was preempted: the test proves nothing"
    assert any(r.images is not None for r in chunked), "no image prompt was chunked: the test proves nothing"
    assert engine.scheduler.allocator.num_used == 0 and engine.scheduler.state_allocator.num_used == 0
    assert len({tuple(t) for t in alone}) > 12, "outputs barely differ: the test proves little"


def test_states_are_made_once_per_admission(mllama, cases):
    """The image encoder runs at a request's first step only (decode steps read the stored states)."""
    _, _, model, config = mllama
    engine = engine_for(model, config)
    counters = engine.runner.vision_counters
    jobs = [(ids, i) for _, _, ids, i in cases]
    run(engine, jobs)
    assert counters.encoded_images == sum(i.num_images for _, i in jobs if i is not None)


def test_image_states_have_a_pool_of_their_own(mllama, cases):
    """The cross layers' caches hold only image states: a pool of their own, as many slots as the token pool's,
    with the token pool's memory per slot split between them (no layer's cache spans both)."""
    _, _, model, config = mllama
    engine = engine_for(model, config, max_batch_total_tokens=256)
    runner, scheduler = engine.runner, engine.scheduler
    assert runner.state_layers == [1, 3] and runner.token_layers == [0, 2, 4]
    assert scheduler.state_allocator is not scheduler.allocator
    assert scheduler.config.num_state_blocks == scheduler.config.num_blocks == 16
    assert all(runner.kv_caches[i][0].shape[0] == 16 for i in range(5))
    _, _, ids, images = cases[3]  # two images: 1 + 2 real tiles, 5 states each
    request = engine.add_request(ids, PARAMS, images=images)
    engine.step()
    assert request.num_states == 15 and len(request.cross_block_ids) == 1 and len(request.block_ids) == 1
    assert scheduler.state_allocator.num_used == 1 and scheduler.allocator.num_used == 1
    engine.abort_request(request.request_id)
    assert scheduler.state_allocator.num_used == 0 and scheduler.allocator.num_used == 0


def test_image_states_count_against_the_prefill_budget(mllama, cases):
    """The image encoder runs, whole, in the step that admits a request: its states draw on that step's prefill
    budget, so two image requests that would overrun it start in different steps."""
    _, _, model, config = mllama
    _, _, ids, images = cases[3]  # 15 states (two images: 1 + 2 real tiles)
    engine = engine_for(model, config, max_batch_prefill_tokens=len(ids) + 15)
    first, second = (engine.add_request(ids, PARAMS, images=images) for _ in range(2))
    assert [s.request for s in engine.scheduler.schedule().scheduled] == [first]
    assert second in engine.scheduler.waiting


def test_an_adapter_trained_on_the_transformers_4_layout_loads_the_same(mllama, tmp_path):
    """PEFT on transformers 4's MllamaForConditionalGeneration (most Llama 3.2 Vision adapters) names modules
    `language_model.model.*`, `language_model.lm_head`, `vision_model.*`, `multi_modal_projector`."""
    import json

    from loraplex.lora.adapter import load_adapter_dir

    hf, _, model, config = mllama
    source = tmp_path / "v5"
    # Suffixes, as such adapters list them: the config matches either layout's names.
    suffixes = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc1", "fc2", "lm_head"]
    mllama_peft_adapter(hf, suffixes, source, seed=4)
    renames = [("base_model.model.model.language_model.", "base_model.model.language_model.model."),
               ("base_model.model.model.vision_model.", "base_model.model.vision_model."),
               ("base_model.model.lm_head.", "base_model.model.language_model.lm_head.")]
    old_layout = tmp_path / "v4"
    tensors = relayout_adapter(source, old_layout, renames)
    assert any(k.startswith("base_model.model.language_model.model.layers.1.cross_attn.") for k in tensors)
    assert json.loads((old_layout / "adapter_config.json").read_text())["target_modules"]

    shapes = engine_for(model, config, max_active_adapters=1).lora.base_shapes
    weight = lambda m: model.get_submodule(m).weight  # noqa: E731
    new = load_adapter_dir(source, "v5", shapes, 64, weight)
    old = load_adapter_dir(old_layout, "v4", shapes, 64, weight, type(model).checkpoint_name)
    assert set(old.modules) == set(new.modules)
    assert {"lm_head", "model.language_model.layers.3.cross_attn.v_proj",
            "model.vision_model.global_transformer.layers.0.mlp.fc1"} <= set(new.modules)
    for name, weights in new.modules.items():
        assert torch.equal(old.modules[name].a, weights.a) and old.modules[name].scale == weights.scale
