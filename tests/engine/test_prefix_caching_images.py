"""Prefix caching for vision requests (LLaVA-NeXT: images in the token stream; Mllama: image states read by
cross-attention): the same text with the same image hits every full block, the same text with another image
only the blocks before the image; outputs equal those without caching."""

from __future__ import annotations

import pytest

from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.params import SamplingParams
from tests.helpers import engine_for
from tests.mllama_fixtures import pictures, request_inputs, tiny_pair
from tests.models.test_llava_next_parity import IMAGE_TOKEN, WIDE, image, inputs, processor, saved, tiny_llava

BS = 4
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


def llava_request(proc, text, seed):
    ids, pixel_values, sizes = inputs(proc, text, [image(WIDE, seed)])
    return ids, ImageInputs.for_prompt(ids, pixel_values, sizes, IMAGE_TOKEN)


def mllama_request(proc, text, seed):
    return request_inputs(proc, text, pictures([(30, 60)], seed))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model, config = saved(tiny_llava(seed=0), tmp_path_factory.mktemp("llava"))
    proc = processor()
    return model, config, lambda seed: llava_request(proc, "w1 w2 w3 w4 w5 w6 w7 w8 w9 <image> w3 w99 w42", seed)


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    _, proc, model, config = tiny_pair(tmp_path_factory.mktemp("mllama"))
    return model, config, lambda seed: mllama_request(proc, "w1 w2 w3 w4 w5 w6 w7 w8 w9 <|image|>w3 w9 w12", seed)


def generate(engine, ids, images) -> tuple[list[int], int]:
    """One request's tokens and the prompt tokens it found cached."""
    before = engine.scheduler.prefix_hits
    request = engine.add_request(ids, PARAMS, images=images)
    while engine.has_unfinished:
        engine.step()
    return request.output_ids, engine.scheduler.prefix_hits - before


@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_image_requests_hit_only_what_their_images_made(family, request):
    model, config, make_request = request.getfixturevalue(family)
    first = make_request(seed=1)
    other = make_request(seed=2)
    assert first[0] == other[0]  # the same tokens; only the pixels differ
    uncached = engine_for(model, config, block_size=BS, prefix_caching=False)
    expected = [generate(uncached, ids, images)[0] for ids, images in (first, other)]
    assert expected[0] != expected[1], "the tiny model must read its image for this test to mean anything"

    engine = engine_for(model, config, block_size=BS)
    ids, images = first
    assert generate(engine, ids, images) == (expected[0], 0)
    assert generate(engine, ids, images) == (expected[0], (len(ids) - 1) // BS * BS)  # the same image: all of it
    before_image = images.positions[0] // BS * BS
    assert before_image >= 2 * BS
    assert generate(engine, *other) == (expected[1], before_image)  # another image: the text before it only
