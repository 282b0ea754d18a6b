"""LLaVA 1.5 (`model_type: llava`, one tile per image) against transformers: a tiny random
`LlavaForConditionalGeneration` saved with save_pretrained and loaded by our loader, images through the real
LlavaProcessor (CLIPImageProcessor: resize and centre-crop to one tile; no image_sizes in its output).
Logits and features close, greedy tokens equal to `generate` through the engine and over HTTP; the image
matters; PEFT adapters on the language model, projector and tower match PEFT, alone and in mixed batches."""

from __future__ import annotations

import shutil

import pytest
import torch

from loraplex.checkpoints.weights import WeightsError
from loraplex.engine.loading import build_model
from loraplex.models.registry import config_from_hf
from loraplex.multimodal import MediaConfig
from loraplex.multimodal.image_inputs import ImageInputs
from tests.engine.test_llava_engine import NEW, run
from tests.helpers import engine_for
from tests.lora.peft_helpers import peft_model, save_and_load
from tests.models.test_llava_next_parity import (
    IMAGE_TOKEN, TALL, TEXT, VOCAB, WIDE, image, load_dir, paged_logits, saved, with_visible_images,
)
from tests.models.test_llava_next_parity import processor as next_processor
from tests.server.test_images_http import NEW as HTTP_NEW
from tests.server.test_images_http import TEMPLATE, call, chat, data_url, make_app, png, tokens_of, transformers_answer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SIDE, PATCH = 42, 14
PLACEHOLDERS = (SIDE // PATCH) ** 2  # per image with the "default" strategy (576 for 336/14)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=SIDE,
              patch_size=PATCH)
PROMPTS = [  # (text, image sizes)
    ("w5 w17 <image> w3 w99 w42", [WIDE]),
    ("w1 <image> w2 w3 <image> w4", [WIDE, TALL]),
    ("w8 w9 w10 w11", []),
    ("<image> w60 w61 w62", [TALL]),
]
LORA_CASES = {
    "language": dict(r=4, lora_alpha=8,
                     target_modules=r"model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj|down_proj)"),
    "vision": dict(r=4, lora_alpha=8,  # the tower and the projector
                   target_modules=r"model\.(vision_tower\..*\.(q_proj|out_proj|fc1)|multi_modal_projector\.linear_[12])"),
    "everything": dict(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj", "fc1", "fc2",
        "linear_1", "linear_2", "lm_head"]),
}


def tiny_llava(seed: int = 0, vision_feature_layer=-2, **config):
    torch.manual_seed(seed)
    hf_config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**TEXT), vision_config=transformers.CLIPVisionConfig(**VISION),
        image_token_id=IMAGE_TOKEN, vision_feature_layer=vision_feature_layer, **config,
    )
    return with_visible_images(transformers.LlavaForConditionalGeneration(hf_config).eval())


def processor(strategy: str = "default"):
    """The real LlavaProcessor as llava-hf ships it (CLS counted, then dropped by "default"), on the tiny vocabulary."""
    images = transformers.CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    proc = transformers.LlavaProcessor(
        image_processor=images, tokenizer=next_processor().tokenizer, patch_size=PATCH,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
    )
    proc.chat_template = TEMPLATE
    return proc


def inputs(proc, text, sizes, seed=0):
    """Prompt ids, pixel_values [images, 3, H, W] as the processor made them, original (height, width)s."""
    out = proc(text=text, images=[image(s, seed + i) for i, s in enumerate(sizes)] or None, return_tensors="pt")
    return out["input_ids"][0].tolist(), out.get("pixel_values"), list(sizes)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    hf = tiny_llava(seed=0)
    return hf, *saved(hf, tmp_path_factory.mktemp("llava")), processor()


@pytest.fixture(scope="module")
def requests(llava):
    return [inputs(llava[3], text, sizes, seed=10 * i) for i, (text, sizes) in enumerate(PROMPTS)]


@torch.inference_mode()
def hf_logits(hf, ids, pixel_values=None) -> torch.Tensor:
    kw = {} if pixel_values is None else dict(pixel_values=pixel_values)
    return hf(input_ids=torch.tensor([ids]), **kw).logits[0]


@torch.inference_mode()
def hf_greedy(hf, ids, pixel_values=None, _sizes=None) -> list[int]:
    kw = {} if pixel_values is None else dict(pixel_values=pixel_values)
    out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def ours_logits(ours, config, ids, pixel_values=None) -> torch.Tensor:
    tiles = None if pixel_values is None else pixel_values[:, None]  # one tile per image
    return paged_logits(ours, config, ids, tiles)


def assert_logits_match(hf, ours, config, ids, pixel_values=None) -> torch.Tensor:
    want, got = hf_logits(hf, ids, pixel_values), ours_logits(ours, config, ids, pixel_values)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * max(want.abs().max().item(), 1.0))
    return got


@torch.inference_mode()
def assert_features_match(hf, ours, pixel_values, per_image: int) -> None:
    want = hf.model.get_image_features(pixel_values).pooler_output
    got = ours.encode_images(pixel_values[:, None])  # no image_sizes: a single tile needs none
    assert [g.shape for g in got] == [w.shape for w in want] == [(per_image, TEXT["hidden_size"])] * len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


# ---- the model ----------------------------------------------------------------------------------------------


def test_one_image_matches_transformers_and_the_image_matters(llava):
    hf, ours, config, proc = llava
    ids, pixel_values, sizes = inputs(proc, "w5 w17 <image> w3 w99 w42", [WIDE], seed=1)
    assert pixel_values.shape == (1, 3, SIDE, SIDE) and ids.count(IMAGE_TOKEN) == PLACEHOLDERS
    assert ours.tiles_per_image(sizes) == [1] and not hasattr(ours.model, "image_newline")
    assert_features_match(hf, ours, pixel_values, PLACEHOLDERS)
    with_image = assert_logits_match(hf, ours, config, ids, pixel_values)

    # Another picture moves the logits after the placeholders 100x the tolerance; so does dropping it.
    _, other_pixels, _ = inputs(proc, "w5 w17 <image> w3 w99 w42", [WIDE], seed=2)
    after = len(ids) - ids[::-1].index(IMAGE_TOKEN)
    margin = 1e-2 * with_image.abs().max()
    assert (ours_logits(ours, config, ids, other_pixels)[after:] - with_image[after:]).abs().max() > margin
    text_only = [t for t in ids if t != IMAGE_TOKEN]
    assert (ours_logits(ours, config, text_only)[-1] - with_image[-1]).abs().max() > margin


def test_two_images_and_processor_inputs_without_image_sizes(llava):
    hf, ours, config, proc = llava
    out = proc(text="w1 <image> w2 <image> w4", images=[image(WIDE, 3), image(TALL, 4)], return_tensors="pt")
    assert "image_sizes" not in out
    got = ImageInputs.from_processor(out, [WIDE, TALL], IMAGE_TOKEN)
    ids = out["input_ids"][0].tolist()
    assert got.pixel_values.shape == (2, 1, 3, SIDE, SIDE) and got.image_sizes == [WIDE, TALL]
    assert got.positions == [i for i, t in enumerate(ids) if t == IMAGE_TOKEN] and len(got.positions) == 2 * PLACEHOLDERS
    assert_features_match(hf, ours, out["pixel_values"], PLACEHOLDERS)
    assert_logits_match(hf, ours, config, ids, out["pixel_values"])


def test_full_strategy_keeps_the_cls_feature_and_layers_concatenate(tmp_path):
    """"full" keeps CLIP's CLS row as one more placeholder; vision_feature_layer [-2, -1] concatenates."""
    hf = tiny_llava(seed=3, vision_feature_select_strategy="full", vision_feature_layer=[-2, -1])
    ours, config = saved(hf, tmp_path)
    assert config.vision.vision_feature_select_strategy == "full" and config.vision.feature_layers == (-2, -1)
    ids, pixel_values, _ = inputs(processor("full"), "w8 <image> w9 w10", [TALL], seed=5)
    assert ids.count(IMAGE_TOKEN) == PLACEHOLDERS + 1
    assert_features_match(hf, ours, pixel_values, PLACEHOLDERS + 1)
    assert_logits_match(hf, ours, config, ids, pixel_values)


def test_config_normalisation(llava):
    hf, _, config, _ = llava
    raw = hf.config.to_dict()
    assert (config.model_type, config.num_layers, config.head_dim, config.vocab_size) == ("llava", 2, 16, VOCAB)
    v = config.vision
    assert (v.image_size, v.patch_size, v.image_grid_pinpoints, v.image_token_id) == (SIDE, PATCH, (), IMAGE_TOKEN)
    assert (v.vision_feature_layer, v.vision_feature_select_strategy, v.projector_hidden_act) == (-2, "default", "gelu")
    assert not config.tie_word_embeddings
    # transformers 5's LlavaConfig ties when either the top level or the text config says so.
    text_ties = {**raw, "text_config": {**raw["text_config"], "tie_word_embeddings": True}}
    tied = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig.from_dict(text_ties))
    assert tied.lm_head.weight is tied.model.language_model.embed_tokens.weight
    assert config_from_hf(text_ties).tie_word_embeddings
    bad = {
        "vision_config.model_type": {"vision_config": {**raw["vision_config"], "model_type": "siglip_vision_model"}},
        "image_token_id": {"image_token_index": VOCAB},
        "vision_feature_layer": {"vision_feature_layer": -4},
    }
    for field, change in bad.items():
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            config_from_hf({**raw, **change})


def test_weights_in_every_layout(llava, tmp_path):
    """transformers 4's llava-hf names (`vision_tower.vision_model.*`) and transformers 5's in-memory names load
    the same model; a stray `image_newline` (LLaVA-NeXT's) is refused."""
    from safetensors.torch import load_file, save_file

    hf, ours, config, proc = llava
    hf.save_pretrained(tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    assert "language_model.lm_head.weight" in state and "vision_tower.embeddings.class_embedding" in state
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(tmp_path / "src" / "config.json", old / "config.json")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in state.items()},
              str(old / "model.safetensors"))
    in_memory = build_model(config, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    with pytest.raises(WeightsError, match="image_newline"):
        build_model(config, state | {"image_newline": torch.zeros(TEXT["hidden_size"])})
    ids, pixel_values, _ = inputs(proc, "w7 w8 <image> w9", [WIDE], seed=8)
    want = ours_logits(ours, config, ids, pixel_values)
    for model in (load_dir(old)[0], in_memory):
        assert torch.equal(ours_logits(model, config, ids, pixel_values), want)


# ---- through the engine --------------------------------------------------------------------------------------


def test_engine_greedy_equals_transformers_generate(llava, requests):
    hf, ours, config, proc = llava
    want = [hf_greedy(hf, *r) for r in requests]
    engine = engine_for(ours, config, max_batch_total_tokens=2048)
    assert run(engine, requests) == want
    assert [run(engine, [r])[0] for r in requests] == want
    # Chunked prefill cutting through an image's placeholders changes nothing.
    assert run(engine_for(ours, config, max_batch_total_tokens=2048, max_batch_prefill_tokens=5), requests) == want
    # The images matter: every image request answers differently with other pictures.
    other = [(ids, None if pv is None else pv.flip(-1), sizes) for ids, pv, sizes in requests]
    changed = [a != b for a, b, (_, pv, _) in zip(run(engine, other), want, requests) if pv is not None]
    assert changed and all(changed), changed


@pytest.fixture(scope="module")
def base_tokens(llava, requests):
    return [hf_greedy(llava[0], *r) for r in requests]


@pytest.fixture(scope="module")
def adapters(llava, requests, tmp_path_factory):
    """Per case: our adapter (from the files PEFT saved) and the PEFT model's greedy tokens for every request."""
    hf, ours, config, _ = llava
    shapes = engine_for(ours, config, max_active_adapters=1).lora.base_shapes
    out = {}
    for seed, (name, kwargs) in enumerate(LORA_CASES.items()):
        model = peft_model(hf, seed=seed + 1, **kwargs)
        adapter = save_and_load(model, tmp_path_factory.mktemp(name), name, shapes,
                                base_weight=lambda m: ours.get_submodule(m).weight)
        out[name] = (adapter, model, [hf_greedy(model, *r) for r in requests])
    return out


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_matches_peft(llava, requests, adapters, base_tokens, case):
    _, ours, config, _ = llava
    adapter, model, want = adapters[case]
    got = run(engine_for(ours, config, max_batch_total_tokens=2048, max_active_adapters=2), requests,
              [adapter] * len(requests))
    assert got == want
    with_images = [i for i, (_, pixel_values, _) in enumerate(requests) if pixel_values is not None]
    assert any(got[i] != base_tokens[i] for i in with_images), f"{case} changes no image request: proves nothing"
    if case == "vision":  # image rows only: text-only requests answer as the base model
        assert all(got[i] == base_tokens[i] for i in range(len(requests)) if i not in with_images)
    if case == "language":  # PEFT's merged weights answer the same
        import copy

        merged = copy.deepcopy(model).merge_and_unload()
        assert [hf_greedy(merged, *r) for r in requests] == want


def test_mixed_batch_of_base_and_adapters_equals_each_alone(llava, requests, adapters, base_tokens):
    _, ours, config, _ = llava
    variants = [None, *(adapter for adapter, _, _ in adapters.values())]
    expected = [base_tokens, *(want for _, _, want in adapters.values())]
    jobs = [(r, v, e[i]) for i, r in enumerate(requests) for v, e in zip(variants, expected)]
    engine = engine_for(ours, config, max_batch_total_tokens=4096, max_active_adapters=len(variants))
    assert run(engine, [r for r, _, _ in jobs], [v for _, v, _ in jobs]) == [e for _, _, e in jobs]


# ---- over HTTP -------------------------------------------------------------------------------------------------


def test_openai_native_and_tokenize_over_http(llava):
    app, engine = make_app(llava, MediaConfig())
    try:
        picture = png(seed=1)
        openai, native, tokenized = call(
            app, ("POST", "/v1/chat/completions", chat(data_url(picture))),
            ("POST", "/generate", {"inputs": f"w5 w6 ![]({data_url(picture)}) w7",
                                   "parameters": {"max_new_tokens": HTTP_NEW, "ignore_eos_token": True, "details": True}}),
            ("POST", "/tokenize", {"inputs": f"w5 ![]({data_url(picture)}) ![]({data_url(png(seed=2))})"}),
        )
    finally:
        engine.shutdown()
    assert openai.status_code == 200, openai.text
    answer = openai.json()["choices"][0]["message"]["content"]
    assert tokens_of(llava, answer) == transformers_answer(llava, "user: w5 w6 <image> w0 w1", [picture])
    assert openai.json()["usage"]["prompt_tokens"] == PLACEHOLDERS + 5  # "user:" w5 w6 <image>... w0 w1
    assert native.status_code == 200, native.text
    assert [t["id"] for t in native.json()["details"]["tokens"]] == transformers_answer(llava, "w5 w6 <image> w7", [picture])
    assert [t["id"] for t in tokenized.json()] == [5] + [IMAGE_TOKEN] * (2 * PLACEHOLDERS)
