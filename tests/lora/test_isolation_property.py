"""The isolation rule, proved on the arithmetic alone: for random slot assignments, random adapters and
random poison (NaN, +inf, -inf, huge values put into installed weights, so past every load-time check),
every row of an unpoisoned adapter and every base-model row comes out bit for bit as it does when the
poisoned adapters are replaced by clean ones, in the segmented and in the stacked form."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from loraplex.layers.forward_context import ForwardContext, forward_context
from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.step.plan import LoraPlan
from loraplex.lora.step.row_maps import lora_segments
from loraplex.lora.device.table import AdapterTable

IN, HIDDEN, OUT = 12, 20, 9
POISON = [math.nan, math.inf, -math.inf, 3e38]


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


MODEL = TwoLinears().eval()
SLOTS = AdapterTable(MODEL, num_slots=6, device=torch.device("cpu"), dtype=torch.float32)


def make_adapter(seed: int, rank: int, targets: tuple[str, ...], poison: tuple[str, str, float] | None) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for name in targets:
        fan_in, fan_out = {"up": (IN, HIDDEN), "down": (HIDDEN, OUT)}[name]
        weights = LoraWeights(torch.randn(rank, fan_in, generator=gen), torch.randn(fan_out, rank, generator=gen), 1.5)
        if poison is not None and poison[0] == name:
            part, value = poison[1], poison[2]
            if part == "scale":
                weights.scale = value
            else:
                tensor = getattr(weights, part)
                tensor.view(-1)[seed % tensor.numel()] = value
        modules[name] = weights
    return LoraAdapter(f"a{seed}", modules, LoraConfig(r=rank, lora_alpha=1.5 * rank, target_modules=targets))


@st.composite
def scenarios(draw):
    num_adapters = draw(st.integers(1, 6))
    adapters = []
    for i in range(num_adapters):
        targets = draw(st.sampled_from([("up",), ("down",), ("up", "down")]))
        poison = None
        if draw(st.booleans()):
            poison = (draw(st.sampled_from(targets)), draw(st.sampled_from(["a", "b", "scale"])), draw(st.sampled_from(POISON)))
        adapters.append((draw(st.integers(0, 10_000)), draw(st.sampled_from([1, 2, 4, 8])), targets, poison))
    # Rows: base-model rows first, then each slot's rows (the runner orders them so).
    base_rows = draw(st.integers(0, 3))
    counts = [draw(st.integers(0, 4)) for _ in range(num_adapters)]
    return adapters, base_rows, counts


def run(adapters: list[LoraAdapter], base_rows: int, counts: list[int], stacked: bool, x: torch.Tensor) -> torch.Tensor:
    for slot, adapter in enumerate(adapters):
        SLOTS.install(slot, adapter)
    slots = [None] + list(range(len(adapters)))
    segments = lora_segments(slots, [base_rows, *counts])
    rows = LoraPlan(tokens=segments, logits=[], weights=SLOTS.columns) if segments else None
    if rows is not None and stacked:
        rows.stack = SLOTS.stack(tuple(sorted({s.slot for s in segments})))
        rows.groups["tokens"] = rows.stack.groups(segments, torch.device("cpu"))
    with torch.inference_mode(), forward_context(ForwardContext(None, [], None, rows)):
        return MODEL(x)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), stacked=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_unpoisoned_rows_are_bit_identical_whatever_other_slots_hold(scenario, stacked, seed):
    specs, base_rows, counts = scenario
    x = torch.randn(base_rows + sum(counts), IN, generator=torch.Generator().manual_seed(seed))
    poisoned = [make_adapter(s, r, t, p) for s, r, t, p in specs]
    clean = [make_adapter(s, r, t, None) for s, r, t, _ in specs]

    got = run(poisoned, base_rows, counts, stacked, x)
    want = run(clean, base_rows, counts, stacked, x)

    row_owner = [None] * base_rows + [i for i, n in enumerate(counts) for _ in range(n)]
    unpoisoned = [r for r, owner in enumerate(row_owner) if owner is None or specs[owner][3] is None]
    assert torch.equal(got[unpoisoned], want[unpoisoned])
    assert torch.isfinite(got[unpoisoned]).all()
    # And the clean run is the LoRA arithmetic, row by row, in float64.
    assert torch.allclose(want, reference(clean, row_owner, x), rtol=1e-4, atol=1e-4)


def reference(adapters: list[LoraAdapter], row_owner: list[int | None], x: torch.Tensor) -> torch.Tensor:
    out = []
    for row, owner in zip(x.double(), row_owner):
        h = row
        for name in ("up", "down"):
            base = getattr(MODEL, name).base
            y = base.weight.double() @ h + base.bias.double()
            lora = adapters[owner].modules.get(name) if owner is not None else None
            if lora is not None:
                y = y + lora.scale * (lora.b.double() @ (lora.a.double() @ h))
            h = torch.relu(y) if name == "up" else y
        out.append(h)
    return torch.stack(out).float() if out else x.new_zeros(0, OUT)


def test_the_poisoned_rows_themselves_do_go_bad():
    """The property above is not vacuous: a poisoned adapter does change its own rows."""
    specs = [(1, 4, ("up", "down"), ("down", "b", math.nan)), (2, 4, ("up",), None)]
    x = torch.randn(4, IN)
    for stacked in (False, True):
        got = run([make_adapter(*s) for s in specs], 0, [2, 2], stacked, x)
        assert torch.isnan(got[:2]).any() and torch.isfinite(got[2:]).all()
