"""Our LLaVA-NeXT against transformers on the assembled example model (SmolLM2 + the trained CLIP eye):
logits close and greedy tokens identical, for one picture and for two of different shapes."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.engine.loading import build_model
from loraplex.example_models.vision import example_model_dir, make_shape_image, user_message
from loraplex.models.registry import config_from_hf
from tests.models.test_llava_next_parity import assert_parity


@pytest.fixture(scope="module")
def example():
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    path = example_model_dir()
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    ours = build_model(config, load_state_dict(source))
    hf = LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return hf, ours, config, AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("count", [1, 2])
def test_example_model_matches_transformers(example, count):
    hf, ours, config, processor = example
    rng = random.Random(count)
    pictures = [make_shape_image(rng).image for _ in range(count)]
    content = [{"type": "image"}] * count + [{"type": "text", "text": "What colour is the shape?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=prompt, images=pictures, return_tensors="pt", add_special_tokens=False)
    ids = inputs["input_ids"][0].tolist()
    assert_parity(hf, ours, config, ids, inputs["pixel_values"], inputs["image_sizes"].tolist())
