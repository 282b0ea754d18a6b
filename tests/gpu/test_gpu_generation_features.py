"""Prefix caching and speculative decoding on a GPU (run on a CUDA machine: `python -m pytest tests/gpu`; not in
`make test`): a random-weight model of SmolLM2-135M's shape gives the same greedy tokens with each feature on
and off, exactly in float32; in bfloat16 GEMMs pick other kernels for other row counts, so near-ties may flip
(as for batch invariance, tests/gpu/test_gpu_parity.py)."""

import random

import pytest
import torch

from loraplex.params import SamplingParams
from tests.gpu.test_gpu_parity import DEVICE, DTYPES, SMOLLM2_SHAPE
from tests.helpers import engine_for, ours_from_hf, tiny_hf_model

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def model(request):
    hf = tiny_hf_model("llama", **SMOLLM2_SHAPE).to(DEVICE, request.param)
    ours, config = ours_from_hf(hf, device=DEVICE, dtype=request.param)
    return ours, config, request.param


def agree(expected, got, dtype) -> None:
    same = sum(a == b for a, b in zip(expected, got))
    print(f"{dtype}: {same}/{len(expected)} requests identical")
    assert same == len(expected) if dtype is torch.float32 else same >= len(expected) * 3 // 4


def test_prefix_caching_on_and_off(model):
    ours, config, dtype = model
    rng = random.Random(0)
    system = [rng.randrange(49152) for _ in range(300)]
    prompts = [system + [rng.randrange(49152) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    off = engine_for(ours, config, device=DEVICE, dtype=dtype, prefix_caching=False).generate(prompts, params)
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype)
    on = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    assert engine.scheduler.prefix_hits >= 15 * 288
    agree([r.token_ids for r in off], [r.token_ids for r in on], dtype)


def test_speculative_decoding_on_and_off(model):
    ours, config, dtype = model
    rng = random.Random(1)
    # Repetitive prompts: n-gram lookup finds drafts in them (and in the loops greedy random models fall into).
    prompts = [[rng.randrange(49152) for _ in range(20)] * 4 for _ in range(8)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    off = engine_for(ours, config, device=DEVICE, dtype=dtype).generate(prompts, params)
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype, speculative_tokens=4)
    on = engine.generate(prompts, params)
    print(f"{dtype}: drafted {engine.spec_decode.draft_tokens}, accepted {engine.spec_decode.accepted_tokens}")
    assert engine.spec_decode.draft_tokens > 0
    agree([r.token_ids for r in off], [r.token_ids for r in on], dtype)
