"""A config.json and its weights file that disagree load as transformers loads them, with a one-line warning:
MPT saying `no_bias: false` over a file with no biases (transformers builds MPT without biases), and T5 saying
`tie_word_embeddings: false` over a file with no `lm_head.weight` (transformers 5 always ties T5's head)."""

from __future__ import annotations

import json
import logging

import safetensors.torch
import torch

from tests.helpers import encoder_decoder_logits, full_logits, load_saved, tiny_mpt, tiny_t5
from tests.lora.peft_helpers import reference_logits

PROMPT = [5, 17, 42, 99, 3, 250, 7, 1, 64, 128, 11]


def rewrite_config(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    for name, value in fields.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    (path / "config.json").write_text(json.dumps(config))


def test_mpt_saying_biases_over_a_file_without_them_loads_without(tmp_path, caplog):
    hf = tiny_mpt(seed=3)
    hf.save_pretrained(tmp_path)
    rewrite_config(tmp_path, no_bias=False)
    assert not any(name.endswith(".bias") for name in safetensors.torch.load_file(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="loraplex.loading"):
        ours, config = load_saved(tmp_path)
    assert any("no_bias: false" in r.getMessage() for r in caplog.records)
    assert config.mpt.no_bias is False  # what the file says; the model is built as transformers builds it
    torch.testing.assert_close(full_logits(ours, config, PROMPT), reference_logits(hf, PROMPT), atol=2e-4, rtol=1e-4)


def test_t5_saying_untied_over_a_file_without_a_head_loads_tied(tmp_path, caplog):
    import transformers

    hf = tiny_t5(gated=True, seed=2)
    hf.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(tmp_path / "model.safetensors")
    weights.pop("lm_head.weight", None)
    safetensors.torch.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    rewrite_config(tmp_path, tie_word_embeddings=False, scale_decoder_outputs=None)  # as older transformers wrote v1.1
    reference = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert reference.lm_head.weight.data_ptr() == reference.shared.weight.data_ptr()
    with caplog.at_level(logging.WARNING, logger="loraplex.loading"):
        ours, config = load_saved(tmp_path)
    assert any("no lm_head.weight" in r.getMessage() for r in caplog.records)
    encoder_ids, decoder_ids = [7, 99, 42, 18, 3, 1], [0, 7, 99, 42]
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
    torch.testing.assert_close(got, want.float(), atol=2e-4, rtol=1e-4)
