"""LLaVA-NeXT through the engine: image requests of different shapes, several images in one request and
text-only requests share steps, each equal to transformers' greedy `generate` and to itself served
alone; chunked prefill that splits an image's placeholders and preemption change nothing; LoRA on the
language model, the projector and the vision tower matches PEFT, in mixed batches too."""

from __future__ import annotations

import pytest
import torch

from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.lora.adapter import load_adapter_dir
from loraplex.params import SamplingParams
from tests.helpers import engine_for
from tests.lora.peft_helpers import peft_model, relayout_adapter, save_and_load
from tests.models.test_llava_next_parity import IMAGE_TOKEN, TALL, WIDE, image, inputs, processor, saved, tiny_llava

NEW = 6
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
PROMPTS = [  # (text, images)
    ("w5 w17 <image> w3 w99 w42", [WIDE]),
    ("w1 <image> w2 w3 <image> w4", [WIDE, TALL]),
    ("w8 w9 w10 w11", []),
    ("<image> w60 w61 w62", [TALL]),
    ("w7 <image> w70", [(50, 50)]),
]
LORA_CASES = {
    "language": dict(r=4, lora_alpha=8, target_modules=r"model\.language_model\..*\.(q_proj|v_proj|down_proj)"),
    "projector": dict(r=8, lora_alpha=8, target_modules=["linear_1", "linear_2"]),
    "tower": dict(r=4, lora_alpha=4, target_modules=r"model\.vision_tower\..*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)"),
    "everything": dict(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj", "fc1", "fc2",
        "linear_1", "linear_2", "lm_head"]),
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    hf = tiny_llava(seed=0)
    ours, config = saved(hf, tmp_path_factory.mktemp("llava"))
    return hf, ours, config


@pytest.fixture(scope="module")
def requests():
    proc = processor()
    out = []
    for seed, (text, sizes) in enumerate(PROMPTS):
        ids, pixel_values, image_sizes = inputs(proc, text, [image(s, seed) for s in sizes])
        out.append((ids, pixel_values, image_sizes))
    return out


def image_inputs(ids, pixel_values, image_sizes) -> ImageInputs | None:
    return None if pixel_values is None else ImageInputs.for_prompt(ids, pixel_values, image_sizes, IMAGE_TOKEN)


def run(engine, requests, adapters=None):
    adapters = adapters or [None] * len(requests)
    reqs = [engine.add_request(ids, PARAMS, adapter=a, images=image_inputs(ids, pv, sizes))
            for (ids, pv, sizes), a in zip(requests, adapters)]
    finals = {}
    while engine.has_unfinished:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.runner.image_features is not None and len(engine.runner.image_features) == 0  # all freed
    assert engine.scheduler.allocator.num_used == 0
    return [finals[r.request_id].token_ids for r in reqs]


@torch.inference_mode()
def hf_greedy(model, ids, pixel_values, image_sizes) -> list[int]:
    kw = {} if pixel_values is None else dict(pixel_values=pixel_values, image_sizes=torch.tensor(image_sizes))
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def test_mixed_image_and_text_batch_equals_transformers_and_solo(llava, requests):
    hf, ours, config = llava
    want = [hf_greedy(hf, *r) for r in requests]
    engine = engine_for(ours, config, max_batch_total_tokens=2048)
    assert run(engine, requests) == want
    assert [run(engine, [r])[0] for r in requests] == want
    # The images matter: the same prompts with other pictures answer differently.
    other = [(ids, None if pv is None else pv.flip(-1), sizes) for ids, pv, sizes in requests]
    assert run(engine, other) != want


def test_chunked_prefill_splitting_placeholders_and_preemption_change_nothing(llava, requests):
    hf, ours, config = llava
    want = run(engine_for(ours, config, max_batch_total_tokens=2048), requests)
    chunked = engine_for(ours, config, max_batch_total_tokens=2048, max_batch_prefill_tokens=7)
    assert run(chunked, requests) == want
    # A cache too small for all of them at once: requests are preempted and recomputed (images re-encoded).
    small = engine_for(ours, config, max_batch_total_tokens=144, max_batch_prefill_tokens=16)
    preempted = []
    schedule = small.scheduler.schedule

    def watched():
        plan = schedule()
        preempted.extend(plan.preempted)
        return plan

    small.scheduler.schedule = watched
    assert run(small, requests) == want
    assert any(r.images is not None for r in preempted), "no image request was preempted: the test proves nothing"


def test_text_requests_do_not_take_images(llava, requests):
    from loraplex.engine.requests.request import RequestRefused
    from tests.helpers import ours_from_hf, tiny_hf_model

    text_model, text_config = ours_from_hf(tiny_hf_model("llama"))
    engine = engine_for(text_model, text_config)
    with pytest.raises(RequestRefused, match="does not take images"):
        engine.add_request(requests[0][0], PARAMS, images=image_inputs(*requests[0]))


@pytest.fixture(scope="module")
def base_tokens(llava, requests):
    return [hf_greedy(llava[0], *r) for r in requests]


@pytest.fixture(scope="module")
def adapters(llava, requests, tmp_path_factory):
    """Per case: our adapter, read from the files PEFT saved, and PEFT's greedy tokens for every request."""
    hf, ours, config = llava
    shapes = engine_for(ours, config, max_active_adapters=1).lora.base_shapes
    out = {}
    for seed, (name, kwargs) in enumerate(LORA_CASES.items()):
        model = peft_model(hf, seed=seed + 1, **kwargs)
        adapter = save_and_load(model, tmp_path_factory.mktemp(name), name, shapes,
                                base_weight=lambda m: ours.get_submodule(m).weight)
        out[name] = (adapter, [hf_greedy(model, *r) for r in requests])
    return out


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_matches_peft(llava, requests, adapters, base_tokens, case):
    hf, ours, config = llava
    adapter, want = adapters[case]
    engine = engine_for(ours, config, max_batch_total_tokens=2048, max_active_adapters=2)
    got = run(engine, requests, [adapter] * len(requests))
    assert got == want
    with_images = [i for i, (_, pixel_values, _) in enumerate(requests) if pixel_values is not None]
    assert any(got[i] != base_tokens[i] for i in with_images), f"{case} changes no image request: proves nothing"
    if case in ("projector", "tower"):  # image rows only: text-only requests are the base model's
        assert all(got[i] == base_tokens[i] for i in range(len(requests)) if i not in with_images)


def test_mixed_adapters_base_images_and_text_in_one_batch(llava, requests, adapters, base_tokens):
    hf, ours, config = llava
    variants = [None, *(adapter for adapter, _ in adapters.values())]
    expected = [base_tokens, *(want for _, want in adapters.values())]
    jobs = [(r, v, e[i]) for i, r in enumerate(requests) for v, e in zip(variants, expected)]
    for form, threshold in (("segments", 0), ("stacked", 10**6)):
        engine = engine_for(ours, config, max_batch_total_tokens=4096, max_active_adapters=len(variants))
        engine.runner.lora_planner.stacked_rows_per_segment = threshold
        assert run(engine, [r for r, _, _ in jobs], [v for _, v, _ in jobs]) == [e for _, _, e in jobs], form


def test_an_adapter_trained_on_the_transformers_4_layout_loads_the_same(llava, adapters, tmp_path):
    """PEFT on transformers 4's LlavaNextForConditionalGeneration names modules `language_model.model.*`,
    `vision_tower.vision_model.*`, `multi_modal_projector.*`, `language_model.lm_head`."""
    import json


    hf, ours, config = llava
    adapter, _ = adapters["everything"]
    source = tmp_path / "v5"
    peft_model(hf, seed=4, **LORA_CASES["everything"]).save_pretrained(str(source))
    renames = [("base_model.model.model.language_model.", "base_model.model.language_model.model."),
               ("base_model.model.model.vision_tower.", "base_model.model.vision_tower.vision_model."),
               ("base_model.model.model.multi_modal_projector.", "base_model.model.multi_modal_projector."),
               ("base_model.model.lm_head.", "base_model.model.language_model.lm_head.")]
    old_layout = tmp_path / "v4"
    relayout_adapter(source, old_layout, renames)
    assert json.loads((old_layout / "adapter_config.json").read_text())["target_modules"]

    shapes = engine_for(ours, config, max_active_adapters=1).lora.base_shapes
    weight = lambda m: ours.get_submodule(m).weight  # noqa: E731
    new = load_adapter_dir(source, "v5", shapes, 64, weight)
    old = load_adapter_dir(old_layout, "v4", shapes, 64, weight, type(ours).checkpoint_name)
    assert set(old.modules) == set(new.modules) and any("vision_tower" in m for m in old.modules)
    for name, weights in new.modules.items():
        assert torch.equal(old.modules[name].a, weights.a) and old.modules[name].scale == weights.scale
