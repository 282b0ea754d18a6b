"""Mllama on CUDA (`python -m pytest tests/gpu`): prompt logits and greedy tokens against transformers on the
same device and dtype, image and text-only requests in one batch equal to each alone, and LoRA on every
module kind (text, cross-attention, vision, lm_head) against PEFT."""

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import engine_for, image_model_logits, load_saved
from tests.lora.peft_helpers import save_and_load
from tests.mllama_fixtures import (
    ADAPTER_TARGETS, hf_greedy, hf_logits, mllama_peft_adapter, mllama_processor, pictures, request_inputs,
    save_tiny_mllama, tiny_mllama,
)
from tests.models.test_mllama_parity import CASES

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

DEVICE = "cuda"
NEW = 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf, processor = tiny_mllama(seed=0), mllama_processor()
    return hf, processor, save_tiny_mllama(hf, processor, tmp_path_factory.mktemp("mllama"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mllama_matches_transformers_on_cuda(saved, dtype):
    hf, processor, path = saved
    ours, config = load_saved(path)
    hf, ours = hf.to(DEVICE, dtype), ours.to(DEVICE, dtype)
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype)
    jobs, expected = [], []
    for seed, (text, sizes) in enumerate(CASES.values()):
        images = pictures(sizes, seed)
        ids, inputs = request_inputs(processor, text, images)
        jobs.append((ids, inputs))
        expected.append(hf_greedy(hf, processor, text, images, NEW, meta_masking=True))
        ours_logits = image_model_logits(engine, ids, inputs)
        theirs = hf_logits(hf, processor, text, images, meta_masking=True)
        tolerance = 2e-4 if dtype is torch.float32 else 6e-2 * max(1.0, theirs.abs().max().item())
        torch.testing.assert_close(ours_logits.cpu(), theirs, rtol=0, atol=tolerance)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    together = engine.generate([ids for ids, _ in jobs], params, images=[i for _, i in jobs])
    alone = [engine.generate([ids], params, images=[i])[0] for ids, i in jobs]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    if dtype is torch.float32:
        assert [o.token_ids for o in together] == expected
    else:  # bf16: a random tiny model has near-ties; the logits above are the close check
        agree = sum(o.token_ids[0] == e[0] for o, e in zip(together, expected))
        assert agree >= len(jobs) // 2 + 1, f"only {agree} of {len(jobs)} first tokens agree in bf16"


def test_mllama_lora_matches_peft_on_cuda(saved, tmp_path):
    hf, processor, path = saved
    ours, config = load_saved(path)
    ours = ours.to(DEVICE)
    engine = engine_for(ours, config, device=DEVICE, max_active_adapters=2)
    peft = mllama_peft_adapter(hf, ADAPTER_TARGETS["all"], seed=1)
    adapter = save_and_load(peft, tmp_path, "all", engine.lora.base_shapes, base_weight=lambda m: ours.get_submodule(m).weight)
    peft = peft.to(DEVICE)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for seed, (text, sizes) in enumerate(CASES.values()):
        images = pictures(sizes, seed)
        ids, inputs = request_inputs(processor, text, images)
        got = engine.generate([ids], params, adapters=[adapter], images=[inputs])[0].token_ids
        assert got == hf_greedy(peft, processor, text, images, NEW, meta_masking=True), text
