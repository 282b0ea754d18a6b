"""BART / mBART parity against transformers' BartForConditionalGeneration / MBartForConditionalGeneration.

Tiny random models (encoder and decoder of different depth, head count and feed-forward width), saved with
save_pretrained and loaded the way a user's checkpoint is (`load_ours`): decoder logits through the engine's
own encoder-decoder path, and greedy tokens through the engine (prompts of different lengths in one batch)
against transformers' `generate`, which applies the generation config's forced BOS / EOS tokens as our
engine does. Variants: post-norm BART with a tied head, BART with `scale_embedding` and an untied head,
pre-norm mBART (final stack norms, `scale_embedding`). Weights are re-drawn so that the tiny models do not
collapse to one repeated token (the tests check they do not, and that the encoder input matters).
"""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.loading import with_generation_config
from tests.helpers import encoder_decoder_logits, engine_for, greedy_tokens, hf_seq2seq_greedy, load_ours, load_saved

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12
EOS = 2
PROMPTS = [list(range(20, 61)) + [EOS], [5, 17, 42, 99, 3, 120, 7, EOS], [100, EOS]]
VARIANTS = {
    "bart-tied": ("bart", dict()),
    "bart-scaled-untied": ("bart", dict(scale_embedding=True, tie_word_embeddings=False, seed=1)),
    "mbart-scaled": ("mbart", dict(scale_embedding=True)),
    "mbart-untied": ("mbart", dict(tie_word_embeddings=False, seed=2)),
}


def tiny_bart(seed: int = 0, vocab_size: int = 300, kind: str = "bart", logits_bias_std: float = 0.05, **overrides):
    """A random transformers (m)BART whose every weight matters and whose greedy outputs vary: encoder of 2
    layers and 2 heads, decoder of 3 layers and 4 heads, feed-forward widths 80 and 112. Ids: <s>=0 <pad>=1
    </s>=2; BART's decoder starts from </s>, mBART's (no decoder_start_token_id) from <s>; both are forced
    to end with </s>."""
    import transformers

    config_cls, model_cls = {
        "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration),
        "mbart": (transformers.MBartConfig, transformers.MBartForConditionalGeneration),
    }[kind]
    config = config_cls(
        vocab_size=vocab_size, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=4, encoder_ffn_dim=80, decoder_ffn_dim=112, max_position_embeddings=128,
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # LayerNorms at 1/0 and zero biases: perturb
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in name or "shared" in name or "lm_head" in name:  # scaled tokens as large as positions
                scaled = config.scale_embedding and ("shared" in name or "embed_tokens" in name)
                p.normal_(0, config.d_model**-0.5 if scaled else 1.0)
            else:  # sharp attention (large q/k), a strong feed-forward, small self-attention v/out: varied outputs
                strong = name.endswith(("q_proj.weight", "k_proj.weight", "fc1.weight", "fc2.weight"))
                std = 3.0 if strong else 1.0 if "encoder_attn" in name else 0.3
                p.normal_(0, std / p.shape[1] ** 0.5)
        model.final_logits_bias.normal_(0, logits_bias_std)
    # Untied (tie_word_embeddings false), transformers 5 gives the stacks embed_tokens of their own, apart from
    # `shared` and the head: here all four differ, and each is saved.
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    hf = tiny_bart(kind=kind, **overrides)
    ours, config = load_ours(hf, tmp_path_factory.mktemp(request.param))
    return hf, ours, config


def test_config_normalised(pair):
    hf, ours, config = pair
    assert config.num_layers == 3 and config.encoder_decoder.num_encoder_layers == 2
    assert config.num_heads == 4 and config.bart.encoder_attention_heads == 2
    mbart = hf.config.model_type == "mbart"
    assert config.bart.normalize_before == config.bart.add_final_layer_norm == mbart
    assert config.encoder_decoder.decoder_start_token_id == (0 if mbart else 2)
    assert (ours.lm_head.weight is ours.model.shared.weight) == hf.config.tie_word_embeddings
    tied = hf.config.tie_word_embeddings
    assert (ours.model.encoder.embed_tokens is ours.model.shared is ours.model.decoder.embed_tokens) == tied
    assert (ours.model.encoder.embed_tokens is ours.model.decoder.embed_tokens) == tied
    assert config.encoder_decoder.forced_eos_token_ids == (EOS,)


def test_logits_match(pair):
    hf, ours, config = pair
    decoder_ids = [config.encoder_decoder.decoder_start_token_id, 5, 9, 33, 7, 100, 2, 3, 250]
    for encoder_ids in PROMPTS:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids]))
        got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
        torch.testing.assert_close(got, ref.logits[0], atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers(pair):
    hf, ours, config = pair
    got = greedy_tokens(engine_for(ours, config), PROMPTS, NEW)
    assert got == [hf_seq2seq_greedy(hf, p, NEW) for p in PROMPTS]  # forced tokens apply
    assert all(tokens[-1] == EOS for tokens in got)  # forced at the last step max_new_tokens allows
    # The test bites: outputs vary within a sequence and with the encoder input (same length, other tokens).
    assert all(len(set(tokens[:-1])) > 1 for tokens in got), got
    other = [t + 1 for t in PROMPTS[1][:-1]] + [EOS]
    assert greedy_tokens(engine_for(ours, config), [other], NEW) != [got[1]]


def test_forced_bos_token(tmp_path):
    """A generation config's forced_bos_token_id forces the first token, in transformers and here."""
    hf = tiny_bart()
    hf.generation_config.forced_bos_token_id = 7
    ours, config = load_ours(hf, tmp_path)
    config = with_generation_config(config, json.loads((tmp_path / "generation_config.json").read_text()))
    assert config.encoder_decoder.forced_bos_token_id == 7
    expected = [hf_seq2seq_greedy(hf, p, 6) for p in PROMPTS]
    assert all(tokens[0] == 7 and tokens[-1] == EOS for tokens in expected)
    assert greedy_tokens(engine_for(ours, config), PROMPTS, 6) == expected


def test_final_logits_bias_matters(tmp_path):
    """A large final_logits_bias is added to our logits (dropping it would change the greedy choices)."""
    hf = tiny_bart(logits_bias_std=2.0)
    ours, config = load_ours(hf, tmp_path)
    decoder_ids = [config.encoder_decoder.decoder_start_token_id, 5, 9, 33, 7]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPTS[1]]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    got = encoder_decoder_logits(ours, config, PROMPTS[1], decoder_ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (ref - hf.final_logits_bias).argmax(-1).tolist() != ref.argmax(-1).tolist()


def test_config_quirks():
    """mBART configs name no decoder start (transformers' generate then starts from bos_token_id); BART
    configs' fairseq keys (normalize_before, add_final_layer_norm) are ignored, as transformers ignores them."""
    from loraplex.models.registry import config_from_hf

    fairseq = {"model_type": "bart", "vocab_size": 300, "d_model": 64, "normalize_before": True,
               "add_final_layer_norm": True}
    assert not config_from_hf(fairseq).bart.normalize_before
    assert not config_from_hf(fairseq).bart.add_final_layer_norm
    hf = {"model_type": "mbart", "vocab_size": 300, "d_model": 64, "bos_token_id": 0, "decoder_start_token_id": None}
    assert config_from_hf(hf).encoder_decoder.decoder_start_token_id == 0
    assert config_from_hf({**hf, "model_type": "bart"}).encoder_decoder.decoder_start_token_id == 0
    del hf["decoder_start_token_id"]
    assert config_from_hf({**hf, "model_type": "bart"}).encoder_decoder.decoder_start_token_id == 2


def test_checkpoints_without_final_logits_bias_or_with_fairseq_keys_load(tmp_path):
    """transformers loads both (the bias as zeros, `version` ignored); so do we."""
    import safetensors.torch

    hf = tiny_bart(seed=4)
    with torch.no_grad():
        hf.final_logits_bias.zero_()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = safetensors.torch.load_file(path)
    del state["final_logits_bias"]
    state["model.encoder.version"] = torch.tensor([2.0])
    safetensors.torch.save_file(state, path, metadata={"format": "pt"})
    ours, config = load_saved(tmp_path)
    decoder_ids = [2, 5, 9, 33]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([[5, 6, 7, 2]]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    torch.testing.assert_close(encoder_decoder_logits(ours, config, [5, 6, 7, 2], decoder_ids), ref, rtol=0, atol=1e-4)
