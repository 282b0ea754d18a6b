"""The embedded SmolLM2-135M-Instruct against transformers on the same weights (float32, CPU)."""

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import full_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def encoded(embedded):
    tok = embedded.tokenizer
    raw = [tok.encode(p) for p in PROMPTS]
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False) for p in PROMPTS]
    return raw, chat


def test_last_position_logits_match(embedded, embedded_hf, encoded):
    for ids in encoded[0] + encoded[1]:
        expected = embedded_hf(torch.tensor([ids])).logits[0, -1].float()
        got = full_logits(embedded.model, embedded.config, ids)[-1]
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_32_greedy_tokens_identical(embedded, embedded_hf, encoded, make_engine, kind):
    prompts = encoded[0] if kind == "raw" else encoded[1]
    engine = make_engine()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=32))
    eos = engine.tokenizer.eos_token_ids
    for ids, result in zip(prompts, results):
        expected = embedded_hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
        # transformers keeps generating pad after EOS in a batch; alone it stops at EOS like we do.
        assert result.token_ids == expected
        if len(result.token_ids) < 32:
            assert result.token_ids[-1] in eos and result.finish_reason.value == "eos_token"


def test_capital_of_france_names_paris(make_engine):
    engine = make_engine()
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    (result,) = engine.generate([ids], SamplingParams(max_new_tokens=16))
    assert "Paris" in result.generated_text
