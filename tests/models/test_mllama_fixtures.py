"""The Llama 3.2 Vision fixtures bite: images change greedy tokens, an image reaches only the rows from its
`<|image|>` on (with Meta's masking; transformers leaks it into the rows before), every LoRA target set changes
greedy tokens and PEFT wraps exactly the intended modules."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_from_dir  # noqa: E402
from tests.mllama_fixtures import (  # noqa: E402
    ADAPTER_TARGETS, BOS, EOS, IMAGE_TOKEN, PAD, VOCAB, adapted_modules, expected_modules, hf_greedy, hf_inputs,
    hf_logits, image, mllama_peft_adapter, mllama_processor, save_tiny_mllama, tiny_mllama, word_id,
)

pytestmark = pytest.mark.usefixtures("one_thread")

A, B = image(30, 60, 1), image(30, 30, 2)  # 2 tiles (1x2); 1 tile (+ a padding tile)


@pytest.fixture(scope="module")
def model():
    return tiny_mllama(seed=0)


@pytest.fixture(scope="module")
def processor():
    return mllama_processor()


def test_tokens_and_layout(model, processor):
    def ids(text, images):
        return hf_inputs(processor, text, images)["input_ids"][0].tolist()

    w1, w2 = word_id(1), word_id(2)
    assert ids("<|image|>w1 w2", [A]) == [IMAGE_TOKEN, BOS, w1, w2]  # leading images stay before bos
    assert ids("w1 <|image|> w2", [A]) == [BOS, w1, IMAGE_TOKEN, w2]
    assert ids("w1 w2", []) == [BOS, w1, w2]
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5 w6"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<s><|start_header_id|>user<|end_header_id|><|image|>w5 w6<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>"
    )
    assert ids(text, [A]).count(BOS) == 1  # the template's bos: the processor adds no second one
    inputs = hf_inputs(processor, "w1 <|image|> w2", [B])
    assert inputs["pixel_values"].shape == (1, 1, 2, 3, 28, 28)
    assert inputs["aspect_ratio_mask"].tolist() == [[[1, 0]]]
    assert inputs["cross_attention_mask"][0, :, 0].tolist() == [[0, 0], [0, 0], [1, 0], [1, 0]]
    # As in the real checkpoints: lm_head has VOCAB rows, `<|image|>` is id VOCAB, the embedding has VOCAB + 8 rows.
    assert model.lm_head.weight.shape[0] == VOCAB == len(processor.tokenizer) - 1
    assert model.model.language_model.embed_tokens.weight.shape[0] == VOCAB + 8
    assert (model.config.image_token_id, model.config.text_config.eos_token_id, PAD) == (IMAGE_TOKEN, EOS, 0)


def test_image_changes_greedy_tokens(model, processor):
    with_a = hf_greedy(model, processor, "<|image|>w1 w2 w3", [A], 8)
    with_b = hf_greedy(model, processor, "<|image|>w1 w2 w3", [B], 8)
    text_only = hf_greedy(model, processor, "w1 w2 w3", [], 8)
    assert len({tuple(with_a), tuple(with_b), tuple(text_only)}) == 3, (with_a, with_b, text_only)


def test_image_mid_prompt_reaches_rows_from_its_token_on(model, processor):
    text, before = "w1 w2 w3 <|image|> w4 w5", 4  # rows 0..3: bos w1 w2 w3
    la = hf_logits(model, processor, text, [A], meta_masking=True)
    lb = hf_logits(model, processor, text, [B], meta_masking=True)
    plain = hf_logits(model, processor, "w1 w2 w3 w4 w5", [])
    torch.testing.assert_close(la[:before], lb[:before], atol=0, rtol=0)
    torch.testing.assert_close(la[:before], plain[:before], atol=1e-6, rtol=0)  # as if there were no image
    assert ((la[before:] - lb[before:]).abs().amax(-1) > 0.05).all()


def test_transformers_leaks_image_into_rows_before_it(model, processor):
    """transformers masks only the cross layers' MLP on rows that see no image, not the cross attention: those
    rows attend uniformly to all vision tokens. If this fails, transformers fixed it (issue #39379)."""
    text, before = "w1 w2 w3 <|image|> w4 w5", 4
    la, lb = hf_logits(model, processor, text, [A]), hf_logits(model, processor, text, [B])
    assert ((la[:before] - lb[:before]).abs().amax(-1) > 0.05).all()
    # Image first: no row before it, and the two maskings agree.
    torch.testing.assert_close(
        hf_logits(model, processor, "<|image|>w1 w2", [A]),
        hf_logits(model, processor, "<|image|>w1 w2", [A], meta_masking=True), atol=0, rtol=0,
    )


@torch.inference_mode()
def test_every_cross_gate_and_the_projector_matter(model, processor):
    inputs = hf_inputs(processor, "<|image|>w1 w2", [A])
    before = model(**inputs).logits
    params = [
        p for n, p in model.named_parameters() if n.endswith(("_gate", "multi_modal_projector.weight"))
    ]
    assert len(params) == 5
    for p in params:
        saved = p.clone()
        try:
            p.zero_()
            assert not torch.allclose(model(**inputs).logits, before, atol=1e-2)
        finally:
            p.copy_(saved)


def test_save(model, processor, tmp_path):
    import transformers
    from safetensors import safe_open

    path = save_tiny_mllama(model, processor, tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "processor_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # transformers writes the original checkpoint names, not its in-memory ones (model.language_model.*).
    assert {
        "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
        "language_model.model.layers.0.self_attn.q_proj.weight",
        "language_model.model.layers.1.cross_attn.q_proj.weight", "language_model.model.layers.1.cross_attn_attn_gate",
        "vision_model.transformer.layers.0.self_attn.q_proj.weight",
        "vision_model.global_transformer.layers.0.gate_attn", "multi_modal_projector.weight",
    } <= keys
    assert not any(k.startswith("model.") for k in keys)
    assert json.loads((path / "config.json").read_text())["text_config"]["vocab_size"] == VOCAB
    reloaded = transformers.AutoProcessor.from_pretrained(path)
    text = "w1 <|image|> w2 <|eot_id|>"
    for key, value in hf_inputs(processor, text, [A]).items():
        torch.testing.assert_close(hf_inputs(reloaded, text, [A])[key], value, atol=0, rtol=0)


SOME_NAMES = {
    "text": ["model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.4.mlp.down_proj"],
    "cross": ["model.language_model.layers.1.cross_attn.q_proj", "model.language_model.layers.3.cross_attn.o_proj"],
    "vision": ["model.vision_model.transformer.layers.1.mlp.fc2",
               "model.vision_model.global_transformer.layers.0.self_attn.k_proj"],
    "lm_head": ["lm_head"],
    "all": ["lm_head", "model.language_model.layers.2.mlp.up_proj", "model.language_model.layers.3.cross_attn.v_proj",
            "model.vision_model.transformer.layers.0.mlp.fc1"],
    "projections": ["model.language_model.layers.1.mlp.gate_proj",
                    "model.vision_model.transformer.layers.0.self_attn.o_proj"],
}
NOT_NAMES = {
    "text": ["model.language_model.layers.1.mlp.gate_proj", "model.language_model.layers.1.cross_attn.q_proj",
             "lm_head"],
    "cross": ["model.language_model.layers.1.mlp.gate_proj", "model.language_model.layers.0.self_attn.q_proj"],
    "vision": ["model.language_model.layers.0.self_attn.q_proj", "model.multi_modal_projector"],
    "lm_head": ["model.language_model.layers.0.self_attn.q_proj"],
    "all": ["model.language_model.layers.1.mlp.gate_proj", "model.multi_modal_projector"],
    "projections": ["lm_head", "model.vision_model.transformer.layers.0.mlp.fc1"],
}
COUNTS = {"text": 21, "cross": 8, "vision": 18, "lm_head": 1, "all": 48, "projections": 47}


@pytest.mark.parametrize("target", ADAPTER_TARGETS)
def test_adapter_targets(model, processor, target, tmp_path):
    from safetensors import safe_open

    lora = mllama_peft_adapter(model, ADAPTER_TARGETS[target], tmp_path, seed=1)
    names = adapted_modules(lora)
    assert names == expected_modules(model, target) and len(names) == COUNTS[target]
    assert set(SOME_NAMES[target]) <= set(names) and not set(NOT_NAMES[target]) & set(names)

    prompt, text_only = "w1 w2 <|image|> w4 w5", "w1 w2 w4 w5"
    assert hf_greedy(lora, processor, prompt, [A], 8) != hf_greedy(model, processor, prompt, [A], 8)
    unchanged = hf_greedy(lora, processor, text_only, [], 8) == hf_greedy(model, processor, text_only, [], 8)
    assert unchanged == (target in ("cross", "vision"))  # text-only requests skip the vision path entirely

    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    lora_keys = {f"base_model.model.{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    # PEFT counts lm_head as an embedding layer: targeting it also saves the base lm_head weight.
    extra = {"base_model.model.lm_head.base_layer.weight"} if "lm_head" in names else set()
    assert keys == lora_keys | extra


def test_peft_reload_reproduces_logits(model, processor, tmp_path):
    lora = mllama_peft_adapter(model, ADAPTER_TARGETS["all"], tmp_path, seed=2)
    reloaded = peft_from_dir(model, tmp_path)
    prompt = "w1 <|image|> w2 w3"
    torch.testing.assert_close(
        hf_logits(reloaded, processor, prompt, [B]), hf_logits(lora, processor, prompt, [B]), atol=0, rtol=0
    )
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)


def test_projection_list_matches_projections_regex(model):
    lora = mllama_peft_adapter(model, list(ALL_PROJECTIONS))
    assert adapted_modules(lora) == expected_modules(model, "projections")
