"""The example Mllama model `loraplex/smollm2-mllama-shapes` in transformers: the assembled checkpoint loads
whole with MllamaForConditionalGeneration and AutoProcessor, names the colour of held-back pictures (with
transformers' masking of the rows before the picture and with Meta's, which loraplex follows), uses
the picture (gates open, different pictures give different answers), answers text as SmolLM2 does, and
the processor leaves chat-templated prompts' bos alone."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from loraplex.example_models.mllama import example_mllama_dir
from loraplex.example_models.vision import COLOURS, QUESTIONS, colour_in_answer, generate_answers, make_shape_image

TEST_SEED = 31_337  # not a training (20251202) or evaluation (4242) seed


@pytest.fixture(scope="module")
def example():
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    path = example_mllama_dir()
    model, info = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info, AutoProcessor.from_pretrained(path)


def test_loads_whole(example):
    from transformers import MllamaProcessor

    model, info, processor = example
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.model_type == "mllama" and isinstance(processor, MllamaProcessor)
    embed = model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() != embed.data_ptr()  # not tied: 8 rows fewer
    assert torch.equal(model.lm_head.weight, embed[: model.config.text_config.vocab_size])
    assert processor.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image|>")
    assert processor.image_token_id == model.config.image_token_id == 49152
    assert processor.tokenizer("Hello, world!")["input_ids"] == [19556, 28, 905, 17]  # SmolLM2's, no bos added


@pytest.mark.parametrize("masking", ["transformers", "meta"])
def test_names_the_colour_of_held_back_pictures(example, masking):
    """Also with Meta's masking of the rows before the picture (loraplex's; transformers lets those rows see
    the picture, and the model was trained that way): it answers as well either way."""
    from tests.mllama_fixtures import meta_row_masking

    model, _, processor = example
    rng = random.Random(TEST_SEED)
    # 32 pictures, four of each colour, in two batches (a couple of seconds): at the model's ~95% a sample
    # this size keeps the 90% bar clear of chance, as 16 would not (15 of 16 needed).
    pictures = [make_shape_image(rng, colour=colour) for colour in COLOURS for _ in range(4)]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(len(pictures))]
    with meta_row_masking(model) if masking == "meta" else contextlib.nullcontext():
        answers = generate_answers(model, processor, [[p.image] for p in pictures], questions, max_new_tokens=8)
    right = [colour_in_answer(a) == p.colour for a, p in zip(answers, pictures)]
    assert sum(right) >= 0.9 * len(pictures), list(zip(answers, [p.colour for p in pictures]))


def test_the_picture_matters(example):
    model, _, processor = example
    layers = model.model.language_model.layers
    for index in model.config.text_config.cross_attention_layers:  # 0 at transformers' init: training moved them
        gates = layers[index].cross_attn_attn_gate, layers[index].cross_attn_mlp_gate
        assert all(abs(gate.tanh().item()) > 0.02 for gate in gates), (index, gates)
    rng = random.Random(TEST_SEED + 1)
    red = make_shape_image(rng, colour="red", shape="circle", size=(100, 100))
    blue = make_shape_image(rng, colour="blue", shape="circle", size=(100, 100))
    answers = generate_answers(model, processor, [[red.image], [blue.image]], [QUESTIONS[0]] * 2, max_new_tokens=8)
    assert answers[0] != answers[1]
    assert [colour_in_answer(a) for a in answers] == ["red", "blue"], answers


def test_text_only_is_smollm2(example):
    """Without a picture transformers skips the cross-attention layers: what is left is SmolLM2."""
    from transformers import AutoModelForCausalLM

    from loraplex.checkpoints.sources import resolve_model

    model, _, processor = example
    smollm2 = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    ids = processor(text=prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist().count(1) == 3  # <|im_start|> (SmolLM2's bos) as the template puts it, none added
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, smollm2(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_processor_bos(example):
    """MllamaProcessor puts the bos token (SmolLM2's is <|im_start|>) after leading <|image|>s of a prompt
    that has none; a chat-templated prompt has one and is left as it is."""
    _, _, processor = example
    picture = make_shape_image(random.Random(TEST_SEED + 2)).image
    raw = processor(images=[[picture]], text=["<|image|>What colour?"])["input_ids"][0]
    assert processor.tokenizer.convert_ids_to_tokens(raw)[:2] == ["<|image|>", "<|im_start|>"]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
        add_generation_prompt=True,
    )
    assert "<|image|>What colour?<|im_end|>" in prompt
    templated = processor(images=[[picture]], text=[prompt])["input_ids"][0]
    assert templated == processor.tokenizer(prompt)["input_ids"]
