"""Sibling projections in one product (layers/projections.py; the runner fuses them on CUDA only): the siblings'
weights become views of one concatenation, and a model with q/k/v and gate/up fused gives the same greedy tokens,
with adapters on those very projections in a heterogeneous batch, as the unfused model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from loraplex.engine.worker import runner as runner_module
from loraplex.layers.projections import fuse_projections, project
from loraplex.params import SamplingParams
from tests.helpers import engine_for, ours_from_hf, tiny_hf_model
from tests.lora.test_lora_batching import make_adapter


@pytest.fixture(scope="module")
def tiny():
    return ours_from_hf(tiny_hf_model("llama", seed=5))


def test_siblings_become_views_of_one_weight_once(tiny):
    model = copy.deepcopy(tiny[0])
    attention = model.model.layers[0].self_attn
    before = [getattr(attention, name).weight.clone() for name in ("q_proj", "k_proj", "v_proj")]
    assert fuse_projections(model) == 2 * len(model.model.layers)
    fused = attention.fused_projections[("q_proj", "k_proj", "v_proj")]
    assert fused.sizes == tuple(w.shape[0] for w in before)
    torch.testing.assert_close(fused.weight, torch.cat(before), rtol=0, atol=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(attention, name).weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert fuse_projections(model) == 2 * len(model.model.layers)
    assert attention.fused_projections[("q_proj", "k_proj", "v_proj")] is fused  # the second pass kept the first
    x = torch.randn(3, before[0].shape[1])
    for got, weight in zip(project(attention, x, ("q_proj", "k_proj", "v_proj")), before):
        torch.testing.assert_close(got, x @ weight.t())
    model.double()  # replaces every parameter: the concatenation is stale, each sibling computes on its own
    for got, weight in zip(project(attention, x.double(), ("q_proj", "k_proj", "v_proj")), before):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, x.double() @ weight.double().t())


class Int8Like(nn.Linear):
    """Stands for a quantized linear (bitsandbytes' are nn.Linear subclasses): it keeps its own product."""


class Owner(nn.Module):
    SIBLINGS = (("a", "b"), ("c", "d"))

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), Int8Like(4, 5)
        self.c, self.d = nn.Linear(4, 3, bias=False), nn.Linear(4, 2)  # one with a bias, one without


def test_siblings_that_cannot_share_a_product_are_left_alone():
    owner = Owner()
    assert fuse_projections(owner) == 0
    assert owner.fused_projections == {}
    x = torch.randn(2, 4)
    a, b = project(owner, x, ("a", "b"))
    torch.testing.assert_close(a, owner.a(x))


def test_greedy_tokens_with_adapters_on_fused_projections_equal_unfused(tiny, monkeypatch):
    model, config = tiny
    shapes = engine_for(model, config, max_active_adapters=1).lora.base_shapes
    targets = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    adapters = [make_adapter(shapes, f"fused-{i}", rank, targets[i:], seed=40 + i) for i, rank in enumerate((4, 8, 16))]
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    chosen = [adapters[i % 3] if i % 4 != 3 else None for i in range(6)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    def tokens(model, fused: bool):
        monkeypatch.setattr(runner_module, "fused_projections_wanted", lambda device: fused)
        engine = engine_for(model, config, max_active_adapters=3)
        solo = [engine.generate([p], params, adapters=[a] if a else None)[0].token_ids for p, a in zip(prompts, chosen)]
        return solo, [o.token_ids for o in engine.generate(prompts, params, adapters=chosen)]

    unfused_solo, unfused_batch = tokens(copy.deepcopy(model), fused=False)
    fused_model = copy.deepcopy(model)
    fused_solo, fused_batch = tokens(fused_model, fused=True)
    assert fused_model.model.layers[0].mlp.fused_projections  # the runner fused them
    assert fused_solo == unfused_solo and fused_batch == unfused_batch == unfused_solo
    base = engine_for(copy.deepcopy(model), config).generate(prompts, params)
    assert [o.token_ids for o in base] != unfused_solo  # the adapters change the tokens: the test sees them
