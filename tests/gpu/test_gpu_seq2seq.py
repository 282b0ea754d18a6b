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
    # bfloat16 is judged against float32 transformers: our error must be about transformers' own bfloat16 error.
    reference = hf if dtype == "float32" else type(hf).from_pretrained(tmp_path, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        for p in inputs[:2]:
            decoder = [hf.config.decoder_start_token_id, 5, 9, 33, 7]
            encoder_input = torch.tensor([p], device=DEVICE)
            decoder_input = torch.tensor([decoder], device=DEVICE)
            want = reference(input_ids=encoder_input, decoder_input_ids=decoder_input, use_cache=False).logits[0].float()
            got = encoder_decoder_logits(loaded.model, loaded.config, p, decoder, device=DEVICE)
            scale = max(1.0, want.abs().max().item())
            if dtype == "float32":
                torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * scale)
            else:
                theirs = hf(input_ids=encoder_input, decoder_input_ids=decoder_input, use_cache=False).logits[0].float()
                their_error = (theirs - want).abs().max().item()
                our_error = (got - want).abs().max().item()
                assert our_error <= 1.5 * their_error + 1e-2 * scale, (our_error, their_error)
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
def test_lora_on_seq2seq_on_cuda(tmp_path, family):
    """All targets: a batch mixing the adapter and the base model equals each alone (float32, exact); in
    bfloat16 (T5's wo kept in float32, its delta computed in bfloat16) close to PEFT."""
    hf = build(family)
    hf.save_pretrained(tmp_path / "base")
    targets = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"] if family == "t5" else ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    peft = peft_model(hf, seed=3, r=8, lora_alpha=16, target_modules=targets)
    inputs = prompts()
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engines = {}
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(model_id=str(tmp_path / "base"), device=DEVICE, dtype=dtype, max_batch_total_tokens=4096)
        loaded = load_model(config, log=lambda _: None)
        engines[dtype] = (Engine(loaded, config), loaded)
    engine, _ = engines["float32"]
    adapter = save_and_load(peft, tmp_path / "adapter", "a", engine.lora.base_shapes)
    mixed = engine.generate(inputs * 2, params, adapters=[adapter] * len(inputs) + [None] * len(inputs))
    solo_adapter = [engine.generate([p], params, adapters=[adapter])[0].token_ids for p in inputs]
    solo_base = [engine.generate([p], params)[0].token_ids for p in inputs]
    assert [o.token_ids for o in mixed] == solo_adapter + solo_base
    assert solo_adapter != solo_base

    # bfloat16, judged against PEFT in float32: our error must be about PEFT's own in bfloat16.
    _, loaded = engines["bfloat16"]
    p, decoder = inputs[0], [hf.config.decoder_start_token_id, 5, 9, 33]
    encoder_input, decoder_input = torch.tensor([p], device=DEVICE), torch.tensor([decoder], device=DEVICE)
    with torch.inference_mode():
        peft = peft.to(DEVICE)
        want = peft(input_ids=encoder_input, decoder_input_ids=decoder_input, use_cache=False).logits[0].float()
        theirs = peft.to(torch.bfloat16)(input_ids=encoder_input, decoder_input_ids=decoder_input, use_cache=False).logits[0].float()
        got = encoder_decoder_logits(loaded.model, loaded.config, p, decoder, adapter=adapter, device=DEVICE)
    their_error, our_error = (theirs - want).abs().max().item(), (got - want).abs().max().item()
    assert our_error <= 1.5 * their_error + 1e-2 * max(1.0, want.abs().max().item()), (our_error, their_error)
