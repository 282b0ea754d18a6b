"""The isolation rule on CUDA (`python -m pytest tests/gpu`): adapters poisoned past the load checks (NaN,
inf in A or B) change no other request's greedy tokens, in the segmented and the stacked LoRA form, and
their KV blocks carry nothing to the next owners (bfloat16 and float32)."""

import dataclasses
import math
import random

import pytest
import torch

from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.params import SamplingParams
from tests.helpers import engine_for, ours_from_hf, tiny_hf_model

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

DEVICE = "cuda"
FORMS = {"segments": 0, "stacked": 10**6}


def adapters_for(shapes, count: int) -> list[LoraAdapter]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        rank = (4, 8, 16)[i % 3]
        modules = {name: LoraWeights(torch.randn(rank, fi, generator=gen) / fi**0.5, torch.randn(fo, rank, generator=gen) * 0.5, 1.0)
                   for name, (fi, fo) in shapes.items() if name != "lm_head"}
        out.append(LoraAdapter(f"a{i}", modules, LoraConfig(r=rank, lora_alpha=rank)))
    return out


def poisoned(adapter: LoraAdapter, name: str, part: str, value: float) -> LoraAdapter:
    module = "model.layers.0.self_attn.q_proj"
    tensor = getattr(adapter.modules[module], part).clone()
    tensor[0, 0] = value
    return LoraAdapter(name, {**adapter.modules, module: dataclasses.replace(adapter.modules[module], **{part: tensor})},
                       adapter.config)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_poisoned_adapters_change_no_other_request_on_cuda(form, dtype):
    hf = tiny_hf_model("llama", seed=3)
    ours, config = ours_from_hf(hf, device=DEVICE, dtype=dtype)
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype, max_active_adapters=12)
    engine.runner.lora_planner.stacked_rows_per_segment = FORMS[form]
    good = [None, *adapters_for(engine.lora.base_shapes, 6)]
    bad = [poisoned(good[1], "nan-b", "b", math.nan), poisoned(good[2], "inf-a", "a", math.inf),
           poisoned(good[3], "neg-inf-b", "b", -math.inf)]
    rng = random.Random(0)
    jobs = [([rng.randrange(1, 256) for _ in range(rng.randint(3, 40))], good[i % len(good)]) for i in range(21)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    solo = [engine.generate([p], params, adapters=[a])[0].token_ids for p, a in jobs]

    mixed = engine.generate([p for p, _ in jobs] + [jobs[0][0]] * len(bad), params, adapters=[a for _, a in jobs] + bad)
    assert all(o.error is not None for o in mixed[len(jobs):])
    after = engine.generate([p for p, _ in jobs], params, adapters=[a for _, a in jobs])
    for outputs in (mixed[: len(jobs)], after):
        assert all(o.error is None for o in outputs), "a poisoned adapter's NaN reached another request"
    if dtype == torch.float32:
        assert [o.token_ids for o in mixed[: len(jobs)]] == solo
        assert [o.token_ids for o in after] == solo
        return
    # bfloat16 decode is not batch-invariant (a step's LoRA form and whether it runs as a CUDA graph depend on the
    # batch, and they round alike but reduce in other orders). So the poisoned batch is compared with the same
    # batch whose poisoned adapters are their clean originals: its first step has the same rows in the same forms,
    # so every other request's first token must be the same (after it, the poisoned requests have left).
    clean = engine.generate([p for p, _ in jobs] + [jobs[0][0]] * len(bad), params,
                            adapters=[a for _, a in jobs] + good[1:4])
    assert [o.token_ids[0] for o in mixed[: len(jobs)]] == [o.token_ids[0] for o in clean[: len(jobs)]]
