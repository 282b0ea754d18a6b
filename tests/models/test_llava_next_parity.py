"""LLaVA-NeXT parity with transformers: tiny random models saved with save_pretrained and loaded through our
loader (names remapped), images through the real LlavaNextProcessor, logits through our paged prefill."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import WeightsError, load_state_dict
from loraplex.models.config import ModelConfig
from loraplex.engine.loading import build_model
from loraplex.engine.requests.request import Request
from loraplex.engine.worker.runner import ModelRunner
from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.layers.forward_context import ForwardContext, forward_context
from loraplex.models.registry import config_from_hf
from loraplex.params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, IMAGE_TOKEN = 300, 299
TILE, PATCH = 32, 8
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE, patch_size=PATCH
)
WIDE, TALL = (40, 90), (70, 30)  # (height, width) of test images


def hf_config(vision_feature_layer=-2, **overrides):
    return transformers.LlavaNextConfig(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=transformers.CLIPVisionConfig(**VISION),
        image_token_id=IMAGE_TOKEN,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=vision_feature_layer,
        **overrides,
    )


def tiny_llava(seed: int = 0, **config):
    """A random transformers LLaVA-NeXT whose image path visibly matters."""
    torch.manual_seed(seed)
    model = with_visible_images(transformers.LlavaNextForConditionalGeneration(hf_config(**config)).eval())
    with torch.no_grad():
        model.model.image_newline.normal_()
    return model


@torch.no_grad()
def with_visible_images(model):
    """A random LLaVA (NeXT or 1.5) whose norms and biases are not at their init values and whose image
    rows are as large as its text rows (so the image visibly changes the answer)."""
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias"):  # init leaves norms at 1 and biases at 0
            p.add_(torch.randn_like(p) * 0.1)
        if "multi_modal_projector" in name and name.endswith("weight"):
            p.mul_(4.0)
    return model


def saved(hf, path) -> tuple[torch.nn.Module, ModelConfig]:
    """`hf` saved as transformers saves it, then loaded as loraplex's load_model does."""
    hf.save_pretrained(path)
    return load_dir(path)


def load_dir(path) -> tuple[torch.nn.Module, ModelConfig]:
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    return build_model(config, load_state_dict(source)), config


def processor():
    """The real LlavaNextProcessor over a word-level tokenizer of the tiny vocabulary ("w0".."w297")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(298)} | {"<unk>": 298, "<image>": IMAGE_TOKEN}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", extra_special_tokens={"image_token": "<image>"}
    )
    images = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )
    # As llava-hf ships it: CLIP adds one CLS token, which the "default" strategy drops again.
    return transformers.LlavaNextProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def image(size, seed):
    return (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")


@pytest.fixture(scope="module")
def proc():
    return processor()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """vision_feature_layer -2 (llava-hf's choice): the transformers model and ours, loaded from its save."""
    hf = tiny_llava(seed=0)
    return hf, *saved(hf, tmp_path_factory.mktemp("llava_next"))


def inputs(proc, text, images):
    out = proc(text=text, images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not images:
        return ids, None, None
    return ids, out["pixel_values"], [tuple(s) for s in out["image_sizes"].tolist()]


@torch.inference_mode()
def paged_logits(model, config: ModelConfig, ids, pixel_values=None, image_sizes=None, features=None) -> torch.Tensor:
    """Logits at every position through our paged prefill: embed the tokens, put the images' features
    (given, or encoded from the pixels) in their placeholder rows, run the language model on them."""
    runner = ModelRunner(
        model, config.num_layers, config.num_kv_heads, config.head_dim, 64, 16, torch.device("cpu"), torch.float32
    )
    request = Request("probe", list(ids), SamplingParams(max_new_tokens=1), 0, 0.0)
    request.block_ids = list(range(-(-len(ids) // 16)))
    batch = runner.batches.build([ScheduledRequest(request, len(ids))])
    embeds = model.embed_tokens(batch.input_ids)
    if features is None and pixel_values is not None:
        features = torch.cat(model.encode_images(pixel_values, image_sizes))
    if features is not None:
        rows = (batch.input_ids == config.vision.image_token_id).nonzero().squeeze(1)
        assert len(rows) == len(features), "one feature per placeholder token"
        embeds[rows] = features
    with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend)):
        hidden = model(batch.input_ids, batch.positions, inputs_embeds=embeds)
        return model.compute_logits(hidden).float()


@torch.inference_mode()
def hf_logits(hf, ids, pixel_values=None, image_sizes=None) -> torch.Tensor:
    kw = {} if pixel_values is None else dict(pixel_values=pixel_values, image_sizes=torch.tensor(image_sizes))
    return hf(input_ids=torch.tensor([ids]), **kw).logits[0].float()


def greedy(logits_of, ids, steps=3) -> list[int]:
    out = []
    for _ in range(steps):
        out.append(int(logits_of(ids + out)[-1].argmax()))
    return out


def assert_parity(hf, ours, config, ids, pixel_values=None, image_sizes=None) -> torch.Tensor:
    """Logits close at every position and greedy continuations identical; returns our logits."""
    want = hf_logits(hf, ids, pixel_values, image_sizes)
    got = paged_logits(ours, config, ids, pixel_values, image_sizes)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * max(scale, 1.0))
    features = None if pixel_values is None else torch.cat(ours.encode_images(pixel_values, image_sizes))
    assert greedy(lambda t: paged_logits(ours, config, t, features=features), ids) == greedy(
        lambda t: hf_logits(hf, t, pixel_values, image_sizes), ids
    )
    return got


@torch.inference_mode()
def assert_features_match(hf, ours, pixel_values, image_sizes):
    want = hf.model.get_image_features(pixel_values, torch.tensor(image_sizes)).pooler_output
    got = ours.encode_images(pixel_values, image_sizes)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------


def test_one_image(pair, proc):
    hf, ours, config = pair
    ids, pixel_values, sizes = inputs(proc, "w5 w17 <image> w3 w99 w42", [image(WIDE, 1)])
    assert ours.tiles_per_image(sizes) == [3]  # wide: a 1 x 2 grid + the base tile
    assert_features_match(hf, ours, pixel_values, sizes)
    with_image = assert_parity(hf, ours, config, ids, pixel_values, sizes)

    # The image matters: another picture of the same size moves the logits of the text after it 100x
    # the parity tolerance ...
    _, other_pixels, _ = inputs(proc, "w5 w17 <image> w3 w99 w42", [image(WIDE, 2)])
    other = paged_logits(ours, config, ids, other_pixels, sizes)
    after = len(ids) - ids[::-1].index(IMAGE_TOKEN)  # the first text row after the placeholders
    margin = 1e-2 * with_image.abs().max()
    assert (other[after:] - with_image[after:]).abs().max() > margin
    # ... and so does removing it (the same text without the image's rows).
    text_only = [t for t in ids if t != IMAGE_TOKEN]
    assert (paged_logits(ours, config, text_only)[-1] - with_image[-1]).abs().max() > margin


def test_two_images_of_different_shapes(pair, proc):
    hf, ours, config = pair
    ids, pixel_values, sizes = inputs(proc, "w1 <image> w2 w3 <image> w4", [image(WIDE, 3), image(TALL, 4)])
    assert pixel_values.shape[:2] == (2, 3) and ours.tiles_per_image(sizes) == [3, 3]
    assert_features_match(hf, ours, pixel_values, sizes)
    assert_parity(hf, ours, config, ids, pixel_values, sizes)


def test_text_only_prompt(pair):
    hf, ours, config = pair
    assert_parity(hf, ours, config, [3, 14, 15, 92, 65, 35, 89, 79])


@pytest.mark.parametrize("size", [(32, 32), (33, 100), (100, 33), (61, 64), (64, 61), (17, 200), (300, 40), (127, 129)])
def test_any_resolution_arithmetic(pair, proc, size):
    """Tile counts, grid, unpadding and packing over many aspect ratios: features equal transformers' and
    there is one per placeholder token the processor expands the image to. Padding tiles are never read."""
    hf, ours, _ = pair
    ids, pixel_values, sizes = inputs(proc, "<image>", [image(size, sum(size))])
    assert ours.tiles_per_image(sizes) == [pixel_values.shape[1]]
    padded = torch.cat([pixel_values, torch.full_like(pixel_values[:, :1], float("nan"))], dim=1)
    assert_features_match(hf, ours, padded, sizes)
    assert ours.encode_images(padded, sizes)[0].shape[0] == ids.count(IMAGE_TOKEN)


def test_feature_layers_concatenated_and_tied_embeddings(tmp_path, proc):
    """vision_feature_layer [-2, -1] (two layers' states side by side) on a model with tied embeddings."""
    hf = tiny_llava(seed=5, vision_feature_layer=[-2, -1], tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    ours, config = saved(hf, tmp_path)
    assert config.vision.vision_feature_layer == (-2, -1) and config.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    assert ours.model.multi_modal_projector.linear_1.in_features == 2 * VISION["hidden_size"]
    ids, pixel_values, sizes = inputs(proc, "w8 <image> w9 <image> w10", [image(TALL, 6), image(WIDE, 7)])
    assert_features_match(hf, ours, pixel_values, sizes)
    assert_parity(hf, ours, config, ids, pixel_values, sizes)


def test_full_select_strategy_is_refused_as_transformers_cannot_run_it():
    """The "full" strategy keeps CLIP's CLS token, which the any-resolution grid cannot hold: transformers
    fails on it (CLIP always has a CLS token), so we refuse such a config by name, not guess a layout."""
    hf = tiny_llava(seed=1, vision_feature_select_strategy="full")
    pixel_values = torch.randn(1, 3, 3, TILE, TILE)
    with pytest.raises(RuntimeError):
        hf.model.get_image_features(pixel_values, torch.tensor([WIDE]))
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        config_from_hf(hf.config.to_dict())


def test_vision_linears_see_tiles_as_leading_dimension(pair):
    """Every linear of the tower and the projector gets [all real tiles, tokens, features], images' tiles
    contiguous and in order (LoRA maps rows of tiles to requests)."""
    _, ours, _ = pair
    seen = []
    hooks = [
        m.register_forward_pre_hook(lambda m, args, name=name: seen.append((name, tuple(args[0].shape))))
        for name, m in ours.named_modules()
        if isinstance(m, torch.nn.Linear) and ("vision_tower" in name or "multi_modal_projector" in name)
    ]
    try:
        sizes = [WIDE, (64, 64), TALL]
        ours.encode_images(torch.randn(3, 5, 3, TILE, TILE), sizes)
    finally:
        for h in hooks:
            h.remove()
    assert ours.tiles_per_image(sizes) == [3, 5, 3]
    names = {name for name, _ in seen}
    assert {"model.multi_modal_projector.linear_1", "model.multi_modal_projector.linear_2"} <= names
    assert any(name.endswith("mlp.fc2") for name in names) and any(name.endswith("out_proj") for name in names)
    assert all(len(shape) == 3 and shape[0] == 11 for _, shape in seen), seen


def test_weights_in_every_layout(pair, proc, tmp_path):
    """transformers 4's llava-hf names (`vision_tower.vision_model.*`, `language_model.model.*`,
    `language_model.lm_head.*`) and transformers 5's in-memory names load to the same model."""
    from safetensors.torch import load_file, save_file

    hf, ours, config = pair
    hf.save_pretrained(tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    assert "language_model.lm_head.weight" in state and "image_newline" in state  # how transformers saves
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(tmp_path / "src" / "config.json", old / "config.json")
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in state.items()}
    assert any(k.startswith("vision_tower.vision_model.encoder.layers.1.") for k in renamed)
    save_file(renamed, str(old / "model.safetensors"))
    old_model, old_config = load_dir(old)
    assert old_config == config
    in_memory = build_model(config, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    # Still strict: a stray tensor, or two names for one weight, is refused by name.
    with pytest.raises(WeightsError, match="vision_tower.stray"):
        build_model(config, state | {"vision_tower.stray": torch.zeros(1)})
    with pytest.raises(WeightsError, match="both fill 'lm_head.weight'"):
        build_model(config, state | {"lm_head.weight": state["language_model.lm_head.weight"]})

    ids, pixel_values, sizes = inputs(proc, "w7 w8 <image> w9", [image(WIDE, 8)])
    want = paged_logits(ours, config, ids, pixel_values, sizes)
    for model in (old_model, in_memory):  # `ours` (from transformers' save) is parity-tested above
        assert torch.equal(paged_logits(model, config, ids, pixel_values, sizes), want)


def test_config_normalisation(pair):
    hf, _, config = pair
    raw = hf.config.to_dict()
    assert "image_token_index" in raw  # transformers' own spelling; image_token_id is read too
    assert (config.model_type, config.num_layers, config.num_kv_heads, config.head_dim) == ("llava_next", 2, 2, 16)
    assert (config.vocab_size, config.hidden_size, config.tie_word_embeddings) == (VOCAB, 64, False)
    v = config.vision
    assert (v.hidden_size, v.num_layers, v.image_size, v.patch_size, v.hidden_act) == (32, 2, TILE, PATCH, "quick_gelu")
    assert (v.vision_feature_layer, v.vision_feature_select_strategy, v.image_token_id) == (-2, "default", IMAGE_TOKEN)
    assert v.image_grid_pinpoints == ((32, 64), (64, 32), (64, 64)) and v.projector_hidden_act == "gelu"
    renamed = {k: v for k, v in raw.items() if k != "image_token_index"} | {"image_token_id": 7}
    assert config_from_hf(renamed).vision.image_token_id == 7

    # Older llava-hf configs leave fields at their transformers defaults: they are filled in.
    sparse = json.loads(json.dumps(raw))
    del sparse["vision_config"]["hidden_act"], sparse["text_config"]["intermediate_size"]
    filled = config_from_hf(sparse)
    assert filled.vision.hidden_act == "quick_gelu" and filled.intermediate_size == 11008  # LlamaConfig's

    bad = {
        "vision_config.model_type": {"vision_config": {**raw["vision_config"], "model_type": "siglip_vision_model"}},
        "text_config.model_type": {"text_config": {"model_type": "gpt2"}},
        "image_grid_pinpoints": {"image_grid_pinpoints": [[32, 48]]},
        "vision_feature_layer": {"vision_feature_layer": -4},
        "projector_hidden_act": {"projector_hidden_act": "relu6"},
        "image_token_id": {"image_token_index": VOCAB},
    }
    for field, change in bad.items():
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            config_from_hf({**raw, **change})
