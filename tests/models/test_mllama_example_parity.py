"""Our Mllama against transformers on the assembled example model (`loraplex/smollm2-mllama-shapes`: SmolLM2
plus trained cross-attention layers and vision encoder): logits close and greedy tokens identical, for one
picture and for two of different tilings, with the chat template's system prompt before the pictures (rows
that see no image: Meta's masking on the transformers side, see loraplex/engine/requests/image_states.py)."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.example_models.mllama import EXAMPLE_MLLAMA_MODEL_ID, example_mllama_dir
from loraplex.example_models.vision import make_shape_image
from loraplex.params import SamplingParams
from tests.helpers import image_model_logits
from tests.mllama_fixtures import hf_greedy, hf_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def example():
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    path = example_mllama_dir()
    hf = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine.from_config(EngineConfig(model_id=EXAMPLE_MLLAMA_MODEL_ID, max_batch_total_tokens=2048))
    return hf, engine, AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("count", [1, 2])
def test_example_model_matches_transformers(example, count):
    hf, engine, processor = example
    rng = random.Random(100 + count)
    pictures = [make_shape_image(rng, size=size).image for size in [(150, 60), (60, 60)][:count]]
    content = [{"type": "image"}] * count + [{"type": "text", "text": "What colour is the shape?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=prompt, images=[pictures], return_tensors="pt", add_special_tokens=False)
    token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    images = ImageInputs.from_processor(inputs, [(p.height, p.width) for p in pictures], token_id)
    ids = inputs["input_ids"][0].tolist()
    assert ids.index(token_id) > 10, "the system prompt comes before the picture"
    ours = image_model_logits(engine, ids, images)
    torch.testing.assert_close(ours, hf_logits(hf, processor, prompt, pictures, meta_masking=True), atol=1e-3, rtol=1e-4)
    want = hf_greedy(hf, processor, prompt, pictures, 8, meta_masking=True)
    got = engine.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True), images=[images])[0].token_ids
    assert got == want
