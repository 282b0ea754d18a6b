"""The plumbing of the shrink beside the base product (lora/step/beside.py), on the CPU: which layers start early, with
which columns of the product, and that their deltas then come from the early shrink alone. The kernels themselves
and the streams are CUDA's (tests/gpu/test_gpu_decode_graphs.py compares graphs that take this path with eager
steps); here the shrink is a stand-in that records what it was asked for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loraplex.lora.step.plan as lora_plan
from loraplex.layers.forward_context import ForwardContext, forward_context
from loraplex.layers.projections import fuse_projections, project
from loraplex.lora.step.kernels import PointerTable
from loraplex.lora.step.layers import wrap_linears
from loraplex.lora.step.plan import LoraPlan, PerRowForm
from loraplex.lora.step.row_maps import LoraSegment, LoraTiles

SIZES = {"q": 8, "k": 4, "v": 4}


class Attention(nn.Module):
    SIBLINGS = (("q", "k", "v"),)

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(6, n, bias=False) for n in SIZES.values())
        self.o = nn.Linear(8, 6, bias=False)


class StandIn:
    """What `shrink_beside` was asked for, and an expand that adds the layer's index + 1 to its outputs."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, offsets, widths, x, row_slots, tables, names, max_rank, targeted=None):
        targeted = tuple(range(len(names))) if targeted is None else tuple(targeted)
        call = {"offsets": tuple(offsets), "widths": tuple(widths), "names": tuple(names), "targeted": targeted,
                "outs": None}
        self.calls.append(call)

        class Early:  # as beside.ShrinkBeside: given all the product's outputs, adds to the targeted ones
            def expand(self, product_outs):
                outs = [product_outs[i] for i in targeted]
                call["outs"] = outs
                for i, out in enumerate(outs):
                    out += i + 1

        return Early()


@pytest.fixture
def model(monkeypatch):
    model = nn.Module()
    model.attn = Attention()
    wrap_linears(model)
    assert fuse_projections(model) == 1
    stand_in = StandIn()
    monkeypatch.setattr(lora_plan, "in_graph", lambda x: True)
    monkeypatch.setattr(lora_plan, "shrink_beside", stand_in)
    return model, stand_in


def rows_for(targeted, segments=(), tiles=None):
    tables = PointerTable(["attn.q", "attn.k", "attn.v", "attn.o"], 2, torch.device("cpu"))
    per_row = PerRowForm(torch.tensor([0, 1, -1], dtype=torch.int32), tables, frozenset(targeted), 16, tiles)
    return LoraPlan(tokens=list(segments), logits=[], weights={}, per_row={"tokens": per_row})


def test_the_targeted_siblings_shrink_before_the_product_with_their_columns(model):
    model, stand_in = model
    x = torch.randn(3, 6)
    plain = [getattr(model.attn, n).base(x) for n in SIZES]
    with torch.inference_mode(), forward_context(ForwardContext(None, [], None, rows_for({"attn.q", "attn.v"}))):
        q, k, v = project(model.attn, x, ("q", "k", "v"))
    (call,) = stand_in.calls
    assert call["offsets"] == (0, 12) and call["widths"] == (8, 4) and call["names"] == ("attn.q", "attn.v")
    assert call["targeted"] == (0, 2)
    assert [o.data_ptr() for o in call["outs"]] == [q.data_ptr(), v.data_ptr()]  # the product's own columns
    torch.testing.assert_close(q, plain[0] + 1)
    torch.testing.assert_close(k, plain[1])  # untargeted: nothing added, by either path
    torch.testing.assert_close(v, plain[2] + 2)


def test_a_single_layer_shrinks_before_its_product(model):
    model, stand_in = model
    x = torch.randn(3, 8)
    with torch.inference_mode(), forward_context(ForwardContext(None, [], None, rows_for({"attn.o"}))):
        out = model.attn.o(x)
    (call,) = stand_in.calls
    assert call["offsets"] == (0,) and call["widths"] == (6,) and call["names"] == ("attn.o",)
    torch.testing.assert_close(out, model.attn.o.base(x) + 1)


@pytest.mark.parametrize("case", ["untargeted", "segments", "tiles", "no rows", "float64 input", "3-d input"])
def test_nothing_starts_early_where_the_step_takes_another_path(model, case):
    model, stand_in = model
    layers = [model.attn.q, model.attn.k, model.attn.v]
    x = torch.randn(3, 6)
    rows = {
        "untargeted": rows_for({"attn.o"}),
        "segments": rows_for({"attn.q"}, segments=[LoraSegment(0, 0, 1)]),
        "tiles": rows_for({"attn.q"}, tiles=LoraTiles(torch.zeros(3, 1, dtype=torch.int32), 1)),
        "no rows": None,
        "float64 input": rows_for({"attn.q"}),
        "3-d input": rows_for({"attn.q"}),
    }[case]
    if case == "float64 input":
        x = x.double()
    if case == "3-d input":
        x = x[None]
    with torch.inference_mode(), forward_context(ForwardContext(None, [], None, rows)):
        if rows is None:  # no plan: the wrappers add nothing, and start nothing, around the product
            product = [torch.zeros(3, n) for n in SIZES.values()]
            outs = layers[0].around_product(layers, x, tuple(SIZES.values()), lambda: product)
            assert all(out is made for out, made in zip(outs, product, strict=True))
        else:
            assert rows.begin_siblings(layers, x, tuple(SIZES.values())) is None
    assert stand_in.calls == []


def test_outside_a_graph_nothing_starts_early(model, monkeypatch):
    model, stand_in = model
    monkeypatch.setattr(lora_plan, "in_graph", lambda x: False)
    rows = rows_for({"attn.q"})
    with torch.inference_mode(), forward_context(ForwardContext(None, [], None, rows)):
        assert rows.begin_siblings([model.attn.q], torch.randn(3, 6), (8,)) is None
    assert stand_in.calls == []
