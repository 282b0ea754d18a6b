"""MPT (ALiBi) on CUDA (`python -m pytest tests/gpu`): greedy tokens through the engine against transformers
on the same device (float32 exact; bfloat16 logits close), a mixed batch equal to each alone."""

import random

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, load_ours, tiny_mpt

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

DEVICE = "cuda"


@pytest.mark.parametrize("heads", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mpt_matches_transformers_on_cuda(tmp_path, dtype, heads):
    hf = tiny_mpt(seed=heads, clip_qkv=6.0) if heads == 8 else tiny_mpt(seed=heads)
    ours, config = load_ours(hf, tmp_path)
    hf, ours = hf.to(DEVICE, dtype), ours.to(DEVICE, dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(4, 60))] for _ in range(6)]
    with torch.inference_mode():
        for p in prompts[:2]:
            want = hf(torch.tensor([p], device=DEVICE)).logits[0].float()
            got = full_logits(ours, config, p, DEVICE)
            tolerance = 1e-4 if dtype is torch.float32 else 6e-2
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance * max(1.0, want.abs().max().item()))
        expected = [hf.generate(torch.tensor([p], device=DEVICE), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype, max_batch_total_tokens=2048)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    together = [o.token_ids for o in engine.generate(prompts, params)]
    assert together == [engine.generate([p], params)[0].token_ids for p in prompts]
    if dtype is torch.float32:
        assert together == expected
    else:
        assert sum(t[0] == e[0] for t, e in zip(together, expected)) >= len(prompts) // 2 + 1
