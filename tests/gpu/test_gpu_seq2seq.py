"""Encoder-decoder models on CUDA (`python -m pytest tests/gpu`): T5 and BART through the engine against
transformers on the same device (float32: identical greedy tokens; bfloat16 loaded as transformers loads it,
T5's `wo` kept in float32: logits close), a mixed batch equal to each request alone, and LoRA on top."""

import random

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import load_model
from loraplex.params import SamplingParams
from tests.helpers import encoder_decoder_logits, tiny_t5
from tests.lora.peft_helpers import peft_model, save_and_load

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

DEVICE = "cuda"
NEW = 8


def build(family: str):
    if family == "t5":
        return tiny_t5(gated=True, seed=21)
    from tests.models.test_bart_parity import tiny_bart

    return tiny_bart(seed=21)


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(4, 250) for _ in range(rng.randint(2, 60))] + [1] for _ in range(6)]


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seq2seq_matches_transformers_on_cuda(tmp_path, family, dtype):
    hf = build(family)
    hf.save_pretrained(tmp_path)
    torch_dtype = getattr(torch, dtype)
    # As transformers loads it: in bfloat16, T5's wo stays float32 (its _keep_in_fp32_modules); ours the same.
    hf = type(hf).from_pretrained(tmp_path, dtype=torch_dtype).to(DEVICE).eval()
    config = EngineConfig(model_id=str(tmp_path), device=DEVICE, dtype=dtype, max_batch_total_tokens=4096)
    loaded = load_model(config, log=lambda _: None)
    if family == "t5" and dtype == "bfloat16":
        assert loaded.model.decoder.block[0].layer[2].DenseReluDense.wo.weight.dtype == torch.float32
    engine = Engine(loaded, config)
    inputs = prompts()
    with torch.inference_mode():
        for p in inputs[:2]:
            decoder = [hf.config.decoder_start_token_id, 5, 9, 33, 7]
            want = hf(input_ids=torch.tensor([p], device=DEVICE), decoder_input_ids=torch.tensor([decoder], device=DEVICE),
                      use_cache=False).logits[0].float()
            got = encoder_decoder_logits(loaded.model, loaded.config, p, decoder, device=DEVICE)
            tolerance = 1e-4 if dtype == "float32" else 6e-2
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance * max(1.0, want.abs().max().item()))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    together = [o.token_ids for o in engine.generate(inputs, params)]
    assert together == [engine.generate([p], params)[0].token_ids for p in inputs]
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p], device=DEVICE), do_sample=False, max_new_tokens=NEW, use_cache=False,
                        eos_token_id=None)[0, 1:].tolist()
            for p in inputs
        ]
    if dtype == "float32":
        assert together == expected
    else:
        assert sum(t[0] == e[0] for t, e in zip(together, expected)) >= len(inputs) // 2 + 1


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_lora_on_seq2seq_in_bfloat16_on_cuda(tmp_path, family):
    """All targets (T5's float32 wo included) in bfloat16: close to PEFT, mixed with the base equal to solo."""
    hf = build(family)
    hf.save_pretrained(tmp_path / "base")
    targets = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"] if family == "t5" else ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    config = EngineConfig(model_id=str(tmp_path / "base"), device=DEVICE, dtype="bfloat16", max_batch_total_tokens=4096)
    loaded = load_model(config, log=lambda _: None)
    engine = Engine(loaded, config)
    peft = peft_model(hf, seed=3, r=8, lora_alpha=16, target_modules=targets)
    adapter = save_and_load(peft, tmp_path / "adapter", "a", engine.lora.base_shapes)
    inputs = prompts()
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    mixed = engine.generate(inputs * 2, params, adapters=[adapter] * len(inputs) + [None] * len(inputs))
    solo_adapter = [engine.generate([p], params, adapters=[adapter])[0].token_ids for p in inputs]
    solo_base = [engine.generate([p], params)[0].token_ids for p in inputs]
    assert [o.token_ids for o in mixed] == solo_adapter + solo_base
    assert solo_adapter != solo_base
    peft = peft.to(DEVICE, torch.bfloat16)
    with torch.inference_mode():
        p = inputs[0]
        decoder = [hf.config.decoder_start_token_id, 5, 9, 33]
        want = peft(input_ids=torch.tensor([p], device=DEVICE), decoder_input_ids=torch.tensor([decoder], device=DEVICE),
                    use_cache=False).logits[0].float()
        got = encoder_decoder_logits(loaded.model, loaded.config, p, decoder, adapter=adapter, device=DEVICE)
        torch.testing.assert_close(got, want, rtol=0, atol=8e-2 * max(1.0, want.abs().max().item()))
