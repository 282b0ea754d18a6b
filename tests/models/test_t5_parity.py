"""T5 / mT5 parity against transformers' T5ForConditionalGeneration / MT5ForConditionalGeneration.

Tiny random models (encoder of 2 blocks, decoder of 3; 8 relative-position buckets with max_distance 20 and
inputs longer than that, so the logarithmic buckets are used), saved with save_pretrained and loaded the way a
user's checkpoint is (`load_ours`): decoder logits through the engine's own encoder-decoder path, and greedy
tokens through the engine (prompts of different lengths in one batch) against transformers' `generate`.
Variants: T5 v1.0 (ReLU, head tied to the embedding, output rescaled by d_model^-0.5), T5 v1.1 (gated GELU,
own head) and mT5 as published (gated GELU, own head, `tie_word_embeddings: false`). transformers 5 ties the
head in memory and saves `tie_word_embeddings: true`; an own head is written into the checkpoint afterwards and
transformers reloads it from disk, so both sides use it (both untie when the checkpoint's head differs).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.models.registry import config_from_hf
from tests.helpers import (
    encoder_decoder_logits, engine_for, greedy_tokens, hf_seq2seq_greedy, load_ours, load_saved, tiny_t5,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12
EOS = 1
PROMPTS = [list(range(20, 61)) + [EOS], [5, 17, 42, 99, 3, 120, 7, EOS], [100, EOS]]
VARIANTS = {  # (gated, model_type, seed)
    "t5-v1.0": (False, "t5", 0),
    "t5-v1.1-untied": (True, "t5", 0),
    "mt5-untied": (True, "mt5", 3),
}


def save_with_own_head(hf, path, model_type: str = "t5"):
    """Save as a published v1.1 / mT5 checkpoint is: an own `lm_head.weight` written into the checkpoint
    (transformers 5 saves only the tied embedding), `tie_word_embeddings: false` without transformers 5's
    `scale_decoder_outputs`, the given model_type; transformers' model is reloaded from disk."""
    from transformers import AutoModelForSeq2SeqLM

    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    torch.manual_seed(1)
    tensors["lm_head.weight"] = torch.randn_like(tensors["shared.weight"]) * 0.2
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.pop("scale_decoder_outputs", None)
    config.update(tie_word_embeddings=False, model_type=model_type,
                  architectures=[f"{'MT5' if model_type == 'mt5' else 'T5'}ForConditionalGeneration"])
    (path / "config.json").write_text(json.dumps(config))
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    assert reloaded.config.model_type == model_type
    assert reloaded.lm_head.weight is not reloaded.shared.weight
    assert torch.equal(reloaded.lm_head.weight, tensors["lm_head.weight"])
    return reloaded


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    gated, model_type, seed = VARIANTS[request.param]
    hf = tiny_t5(gated=gated, seed=seed)
    path = tmp_path_factory.mktemp(request.param)
    if gated:
        hf = save_with_own_head(hf, path, model_type)
        ours, config = load_saved(path)
    else:
        ours, config = load_ours(hf, path)
    return request.param, hf, ours, config


def test_config_normalised(pair):
    name, hf, ours, config = pair
    assert config.num_layers == 3 and config.encoder_decoder.num_encoder_layers == 2
    assert (config.t5.num_buckets, config.t5.max_distance) == (8, 20)
    assert config.t5.gated == (name != "t5-v1.0")
    tied = name == "t5-v1.0"
    assert (ours.lm_head.weight is ours.shared.weight) == tied
    assert config.t5.scale_decoder_outputs == tied  # v1.0 rescales; v1.1 and mT5 do not


def test_logits_match(pair):
    _, hf, ours, config = pair
    # A decoder sequence longer than max_distance: the causal log buckets and the one beyond are used too.
    decoder_ids = [0] + [(7 * i + 3) % 300 for i in range(24)]
    for encoder_ids in PROMPTS:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids]))
        got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
        torch.testing.assert_close(got, ref.logits[0], atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers(pair):
    _, hf, ours, config = pair
    got = greedy_tokens(engine_for(ours, config), PROMPTS, NEW)
    assert got == [hf_seq2seq_greedy(hf, p, NEW) for p in PROMPTS]
    # The test bites: outputs vary within a sequence and with the encoder input (same length, other tokens).
    assert all(len(set(tokens)) > 1 for tokens in got), got
    other = [t + 1 for t in PROMPTS[1][:-1]] + [EOS]
    assert greedy_tokens(engine_for(ours, config), [other], NEW) != [got[1]]


def test_mt5_saved_by_transformers5(tmp_path):
    mt5 = save_with_own_head(tiny_t5(gated=True, seed=3), tmp_path / "published", "mt5")
    ours, config = load_ours(mt5, tmp_path / "resaved")  # transformers 5 writes its own config.json
    decoder_ids = [0, 5, 9, 33, 7]
    with torch.no_grad():
        ref = mt5(input_ids=torch.tensor([PROMPTS[1]]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    torch.testing.assert_close(encoder_decoder_logits(ours, config, PROMPTS[1], decoder_ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("proj", ["gated-mish", "swish", "gated-gelu-new", "relu-gated"])
def test_unsupported_feed_forward_refused(proj):
    hf = {"model_type": "t5", "vocab_size": 300, "d_model": 64, "d_kv": 16, "d_ff": 96, "num_heads": 4,
          "feed_forward_proj": proj}
    with pytest.raises(ValueError, match="feed_forward_proj"):
        config_from_hf(hf)
