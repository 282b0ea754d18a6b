"""Llama 3.2 Vision (Mllama) parity with transformers: a tiny random MllamaForConditionalGeneration saved as
transformers saves it and served by our engine, inputs from the real MllamaProcessor.

Reference semantics: transformers with Meta's masking of the rows before a request's first image (those rows
get no cross-layer output; see loraplex/engine/requests/image_states.py). A prompt that starts with its image has no such
row: it matches transformers as it is."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

from loraplex.models.registry import config_from_hf
from loraplex.engine.requests.image_states import image_rows
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.engine.requests.request import RequestRefused
from loraplex.params import SamplingParams
from tests.helpers import engine_for, image_model_logits
from tests.mllama_fixtures import (
    IMAGE_TOKEN, hf_greedy, hf_logits, pictures, request_inputs, tiny_mllama_config, tiny_pair,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 8
# (text, image sizes): tile counts 1 (30x30: one real tile and a padding one) and 2 (1x2 and 2x1 aspect ratios).
CASES = {
    "one image first": ("<|image|>w1 w2 w3 w40", [(30, 60)]),
    "image mid-prompt": ("w4 w5 w90 <|image|>w6 w7", [(33, 31)]),
    "two images": ("w1 <|image|>w2 w3 <|image|> w9 w12", [(30, 30), (60, 30)]),
    "adjacent images": ("w10 <|image|><|image|>w2 w3 <|image|> w9", [(30, 30), (60, 30), (30, 60)]),
    "text only": ("w8 w9 w10 w100", []),
}


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("mllama"))


def test_config_and_names(mllama):
    hf, _, model, config = mllama
    assert config.model_type == "mllama" and config.mllama.cross_attention_layers == (1, 3)
    assert config.mllama.image_token_id == IMAGE_TOKEN == config.vocab_size
    assert set(model.state_dict()) == set(hf.state_dict())  # transformers 5's in-memory names, PEFT's too


def test_config_refusals():
    base = tiny_mllama_config().to_dict()
    with pytest.raises(ValueError, match="cross_attention_layers"):
        config_from_hf({**base, "text_config": {**base["text_config"], "cross_attention_layers": [9]}})
    with pytest.raises(ValueError, match="image_token_index"):
        config_from_hf({**base, "image_token_index": 5})


@pytest.mark.parametrize("positions", [[0], [3], [1, 4], [1, 2, 5], [0, 1], [2, 3, 4], [1, 2, 6, 7, 9], [9]])
def test_image_rows_are_transformers_mask(positions):
    prompt_len = 10
    ids = [IMAGE_TOKEN if i in positions else 7 for i in range(prompt_len)]
    theirs = [(a, prompt_len if b == -1 else b) for a, b in get_cross_attention_token_mask(ids, IMAGE_TOKEN)]
    assert image_rows(positions, prompt_len) == theirs


@pytest.mark.parametrize("case", CASES)
def test_logits_match(mllama, case):
    hf, processor, model, config = mllama
    text, sizes = CASES[case]
    images = pictures(sizes, seed=1)
    ids, inputs = request_inputs(processor, text, images)
    ours = image_model_logits(engine_for(model, config), ids, inputs)
    theirs = hf_logits(hf, processor, text, images, meta_masking=True)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_image_first_prompt_is_plain_transformers(mllama):
    """Meta's masking concerns only rows before the first image: a prompt that starts with its image matches
    transformers as it is."""
    hf, processor, model, config = mllama
    text, sizes = CASES["one image first"]
    images = pictures(sizes, seed=2)
    ids, inputs = request_inputs(processor, text, images)
    assert ids[0] == IMAGE_TOKEN
    ours = image_model_logits(engine_for(model, config), ids, inputs)
    torch.testing.assert_close(ours, hf_logits(hf, processor, text, images), atol=2e-4, rtol=1e-4)


def test_every_case_in_one_batch_is_greedy_transformers(mllama):
    """All cases share steps (different tile counts and aspect ratios, several images, text-only); each
    request's tokens are transformers' for it alone, and the image matters to them."""
    hf, processor, model, config = mllama
    engine = engine_for(model, config)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    requests, expected = [], []
    for seed, (text, sizes) in enumerate(CASES.values()):
        images = pictures(sizes, seed)
        ids, inputs = request_inputs(processor, text, images)
        requests.append(engine.add_request(ids, params, images=inputs))
        expected.append(hf_greedy(hf, processor, text, images, NEW, meta_masking=True))
    outputs = run_all(engine)
    assert [outputs[r.request_id] for r in requests] == expected
    other = hf_greedy(hf, processor, CASES["two images"][0], pictures(CASES["two images"][1], seed=7), NEW, meta_masking=True)
    assert other != expected[2], "the fixture's images must change greedy tokens"


def test_image_token_with_penalty_logprobs_and_top_tokens(mllama):
    """`<|image|>` (past the head's vocabulary) in the prompt: a repetition penalty, prompt logprobs and top
    tokens work, the image token has no prompt logprob, and the tokens are transformers' with the penalty."""
    hf, processor, model, config = mllama
    text, sizes = "w3 w3 <|image|>w3 w5 w3", [(30, 60)]
    images = pictures(sizes, seed=3)
    ids, inputs = request_inputs(processor, text, images)
    engine = engine_for(model, config)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, repetition_penalty=1.8, prompt_logprobs=True, top_n_tokens=3)
    request = engine.add_request(ids, params, images=inputs)
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None
            if out.finished:
                outputs[out.request_id] = out
    out = outputs[request.request_id]
    assert out.token_ids == hf_greedy(hf, processor, text, images, NEW, meta_masking=True, repetition_penalty=1.8)
    assert out.token_ids != hf_greedy(hf, processor, text, images, NEW, meta_masking=True)
    logprobs = [t.logprob for t in out.prompt_tokens]
    image_at = ids.index(IMAGE_TOKEN)
    assert logprobs[0] is None and logprobs[image_at] is None
    theirs = torch.log_softmax(hf_logits(hf, processor, text, images, meta_masking=True), dim=-1)
    for i, value in enumerate(logprobs):
        if i not in (0, image_at):
            assert value == pytest.approx(theirs[i - 1, ids[i]].item(), abs=1e-3)


def test_refusals(mllama):
    _, processor, model, config = mllama
    engine = engine_for(model, config, max_batch_total_tokens=16)  # one block for tokens, one for states
    ids, inputs = request_inputs(processor, "w1 <|image|>w2", pictures([(30, 60)], 0))
    with pytest.raises(RequestRefused, match="image tokens but no images"):  # transformers' processor refuses too
        engine.add_request(ids, SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestRefused, match="image tokens for 2 images"):
        engine.add_request(ids, SamplingParams(max_new_tokens=2), images=ImageInputs.for_prompt(
            ids, torch.cat([inputs.pixel_values] * 2), [(1, 1)] * 2, IMAGE_TOKEN,
            aspect_ratio_ids=torch.cat([inputs.aspect_ratio_ids] * 2), aspect_ratio_mask=torch.cat([inputs.aspect_ratio_mask] * 2),
        ))
    many = "w1 " + "<|image|>" * 3
    ids, inputs = request_inputs(processor, many, pictures([(60, 30)] * 3, 0))
    with pytest.raises(RequestRefused, match=r"30 cross-attention states .*\(16 token slots and 16 state slots\)"):
        engine.add_request(ids, SamplingParams(max_new_tokens=2), images=inputs)  # 3 images x 2 tiles x 5 states


def run_all(engine) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return outputs


def test_rows_seeing_no_image_do_not_depend_on_sdpa_for_fully_masked_rows(mllama, monkeypatch):
    """SDPA's output for a row whose mask hides every key differs by kernel (zeros on this CPU, NaN or an
    unmasked average on CUDA ones): such rows must be zeroed by us, not left to the kernel."""
    from loraplex.layers import attention

    real = attention.F.scaled_dot_product_attention

    def garbage_when_fully_masked(q, k, v, attn_mask=None, **kwargs):
        out = real(q, k, v, attn_mask=attn_mask, **kwargs)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            hidden = ~attn_mask.any(dim=-1, keepdim=True)  # [..., rows, 1]
            out = out.masked_fill(hidden, 7.0)
        return out

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", garbage_when_fully_masked)
    hf, processor, model, config = mllama
    text, sizes = CASES["image mid-prompt"]
    images = pictures(sizes, seed=4)
    ids, inputs = request_inputs(processor, text, images)
    ours = image_model_logits(engine_for(model, config), ids, inputs)
    torch.testing.assert_close(ours, hf_logits(hf, processor, text, images, meta_masking=True), atol=2e-4, rtol=1e-4)
