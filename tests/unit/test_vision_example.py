"""The example vision model `loraplex/smollm2-shapes`: the parts assemble into a transformers checkpoint
that loads cleanly and names the colour of generated pictures; the picture generator is deterministic."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from loraplex.example_models.vision import (
    COLOURS,
    PARTS_DIR,
    QUESTIONS,
    _cache_key,
    colour_in_answer,
    example_model_dir,
    generate_answers,
    make_shape_image,
)

TEST_SEED = 31_337  # not a training or evaluation seed


@pytest.fixture(scope="module")
def example():
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    path = example_model_dir()
    model, info = LlavaNextForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    return path, model.eval(), info, AutoProcessor.from_pretrained(path)


def test_assembled_checkpoint_loads_whole(example):
    path, model, info, processor = example
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.model_type == "llava_next"
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()  # tied
    image_id = model.config.image_token_id
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == image_id == 49152
    assert model.model.language_model.embed_tokens.weight.shape[0] == image_id + 1
    assert example_model_dir() == path  # cached: the second call finds it


def test_language_model_is_the_embedded_smollm2(example):
    from safetensors import safe_open

    from loraplex.checkpoints.sources import resolve_model

    _, model, _, processor = example
    base = resolve_model(None).path
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.7.mlp.down_proj.weight"),
                           model.model.language_model.layers[7].mlp.down_proj.weight)
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"),
                           model.model.language_model.embed_tokens.weight[:-1])
    assert processor.tokenizer("Hello, world!")["input_ids"] == [19556, 28, 905, 17]


def test_names_the_colour_of_generated_pictures(example):
    _, model, _, processor = example
    rng = random.Random(TEST_SEED)
    pictures = [make_shape_image(rng, colour=colour) for colour in COLOURS]  # one of each colour
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(len(pictures))]
    answers = generate_answers(model, processor, [p.image for p in pictures], questions, max_new_tokens=8)
    named = [colour_in_answer(a) for a in answers]
    assert named == [p.colour for p in pictures], list(zip(answers, [p.colour for p in pictures]))
    assert all(a.startswith("The shape is ") for a in answers), answers


def test_cache_key_follows_the_parts(tmp_path):
    from loraplex.checkpoints.sources import resolve_model

    base = resolve_model(None).path
    parts = tmp_path / "parts"
    shutil.copytree(PARTS_DIR, parts)
    key = _cache_key(parts, base)
    assert _cache_key(PARTS_DIR, base) == key
    (parts / "config.json").write_text((parts / "config.json").read_text() + "\n")
    assert _cache_key(parts, base) != key


def test_missing_parts_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="vision_parts.safetensors"):
        example_model_dir(parts_dir=tmp_path)


def test_pictures_are_deterministic_and_as_described():
    a = make_shape_image(random.Random(5))
    b = make_shape_image(random.Random(5))
    assert (a.colour, a.shape, a.image.size) == (b.colour, b.shape, b.image.size)
    assert a.image.tobytes() == b.image.tobytes()
    rng = random.Random(6)
    for _ in range(50):
        picture = make_shape_image(rng)
        assert picture.colour in COLOURS and picture.image.mode == "RGB"
        assert all(40 <= side <= 224 for side in picture.image.size)
    circle = make_shape_image(random.Random(7), colour="red", shape="circle", size=(100, 100))
    assert circle.shape == "circle" and circle.image.size == (100, 100)


def test_colour_in_answer():
    assert colour_in_answer("The shape is red.") == "red"
    assert colour_in_answer("It is Blue!") == "blue"
    assert colour_in_answer("red or blue") is None
    assert colour_in_answer("The shape is a circle.") is None
