"""LoRA on MPT: PEFT adapters on the fused Wqkv, out_proj, up_proj and down_proj (as PEFT names them on
transformers' MptForCausalLM), each alone and all together, give PEFT's greedy tokens through the engine;
a batch mixing them and the base model equals each request alone, in both LoRA forms."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import engine_for, load_ours, tiny_mpt
from tests.lora.peft_helpers import peft_model, save_and_load

NEW = 8
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
CASES = {
    "Wqkv": dict(r=4, lora_alpha=8, target_modules=["Wqkv"]),
    "out_proj": dict(r=8, lora_alpha=8, target_modules=["out_proj"]),
    "ffn": dict(r=4, lora_alpha=16, target_modules=["up_proj", "down_proj"]),
    "all": dict(r=8, lora_alpha=16, target_modules=["Wqkv", "out_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def mpt(tmp_path_factory):
    hf = tiny_mpt(seed=1)
    ours, config = load_ours(hf, tmp_path_factory.mktemp("mpt"))
    return hf, ours, config


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(5, 1000) for _ in range(rng.randint(4, 40))] for _ in range(5)]


@torch.inference_mode()
def greedy(model, prompt) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adapters(mpt, prompts, tmp_path_factory):
    hf, ours, config = mpt
    shapes = engine_for(ours, config, max_active_adapters=1).lora.base_shapes
    out = {}
    for seed, (name, kwargs) in enumerate(CASES.items()):
        model = peft_model(hf, seed=seed + 1, **kwargs)
        out[name] = (save_and_load(model, tmp_path_factory.mktemp(name), name, shapes), [greedy(model, p) for p in prompts])
    return out


@pytest.mark.parametrize("case", CASES)
def test_lora_on_mpt_matches_peft(mpt, prompts, adapters, case):
    hf, ours, config = mpt
    adapter, want = adapters[case]
    engine = engine_for(ours, config, max_batch_total_tokens=2048, max_active_adapters=2)
    got = [o.token_ids for o in engine.generate(prompts, PARAMS, adapters=[adapter] * len(prompts))]
    assert got == want
    assert got != [greedy(hf, p) for p in prompts], f"{case} changes nothing: the test proves nothing"


def test_mixed_adapters_and_base_on_mpt(mpt, prompts, adapters):
    hf, ours, config = mpt
    base = [greedy(hf, p) for p in prompts]
    variants = [(None, base), *adapters.values()]
    jobs = [(p, a, want[i]) for i, p in enumerate(prompts) for a, want in variants]
    for threshold in (0, 10**6):
        engine = engine_for(ours, config, max_batch_total_tokens=4096, max_active_adapters=len(variants))
        engine.runner.lora_planner.stacked_rows_per_segment = threshold
        outs = engine.generate([p for p, _, _ in jobs], PARAMS, adapters=[a for _, a, _ in jobs])
        assert [o.token_ids for o in outs] == [w for _, _, w in jobs], threshold
