"""Held-out users' checkpoints: each config.json of tests/models/hub_configs.py, as published with only its sizes
shrunk, saved by transformers with random weights and served from that directory. Each must give transformers'
logits (float32) and greedy tokens, and with PEFT adapters PEFT's tokens, alone and in one batch mixing two adapters
and the base model, in both LoRA forms (segmented and stacked)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, load_ours
from tests.lora.peft_helpers import peft_model, reference_greedy, reference_logits, save_and_load
from tests.models.hub_configs import HUB_CONFIGS, shrunk

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NEW = 8
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
ADAPTERS = {"all": dict(r=8, lora_alpha=16), "attention-in": dict(r=4, lora_alpha=16)}


def targets(hf, adapter: str) -> list[str]:
    """PEFT's target names for the family: every projection, or the attention's inputs (q and v, or Phi-3's fused
    qkv_proj)."""
    names = {name.rsplit(".", 1)[-1] for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    if adapter == "all":
        return sorted(names)
    return ["q_proj", "v_proj"] if "q_proj" in names else ["qkv_proj"]


@dataclass
class Served:
    hf: object
    ours: object
    config: object
    prompts: list[list[int]]
    adapters: dict  # name -> (our LoraAdapter, PEFT's greedy tokens per prompt)
    base: list[list[int]]  # transformers' greedy tokens per prompt


@pytest.fixture(scope="module", params=sorted(HUB_CONFIGS))
def served(request, tmp_path_factory) -> Served:
    published = shrunk(HUB_CONFIGS[request.param])
    config = transformers.AutoConfig.for_model(published.pop("model_type"), **published)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a misplaced one
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ours, our_config = load_ours(hf, tmp_path_factory.mktemp("model"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    shapes = engine_for(ours, our_config, max_active_adapters=1).lora.base_shapes
    adapters = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        model = peft_model(hf, seed=seed + 1, strength=2.0, target_modules=targets(hf, name), **kwargs)  # strong: tiny random models barely move
        adapters[name] = (save_and_load(model, tmp_path_factory.mktemp(name), name, shapes),
                          [reference_greedy(model, p, NEW) for p in prompts])
    return Served(hf, ours, our_config, prompts, adapters, [reference_greedy(hf, p, NEW) for p in prompts])


def test_base_matches_transformers(served):
    for prompt in served.prompts:
        want = reference_logits(served.hf, prompt)
        torch.testing.assert_close(full_logits(served.ours, served.config, prompt), want, atol=2e-4, rtol=1e-4)
    engine = engine_for(served.ours, served.config)
    assert [o.token_ids for o in engine.generate(served.prompts, PARAMS)] == served.base


def test_adapters_alone_and_mixed_match_peft_in_both_forms(served):
    jobs = [(p, None, served.base[i]) for i, p in enumerate(served.prompts)]
    for adapter, want in served.adapters.values():
        assert want != served.base, "an adapter changes nothing: the test would prove nothing"
        jobs += [(p, adapter, want[i]) for i, p in enumerate(served.prompts)]
    random.Random(1).shuffle(jobs)
    for threshold in (0, 10**6):  # the segmented form, then the stacked form for every decode step
        engine = engine_for(served.ours, served.config, max_active_adapters=len(served.adapters))
        engine.runner.lora_planner.stacked_rows_per_segment = threshold
        outs = engine.generate([p for p, _, _ in jobs], PARAMS, adapters=[a for _, a, _ in jobs])
        assert [o.token_ids for o in outs] == [w for _, _, w in jobs], threshold
