"""The per-step LoRA plan (lora/step/plan.py) on the CPU: which form a step's rows take, and the seams around it (the
LoRA kernels import nothing from layers/; layers/ knows the plan only as an opaque object)."""

from __future__ import annotations

import ast
import pathlib

import torch
from torch import nn

import loraplex
from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.step.plan import LoraPlanner
from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.device.table import AdapterTable

ROOT = pathlib.Path(loraplex.__file__).parent


def table_with(num_slots: int) -> AdapterTable:
    model = nn.Sequential(nn.Linear(4, 3))
    table = AdapterTable(model, num_slots=num_slots, device=torch.device("cpu"), dtype=torch.float32, max_rank=4)
    for slot in range(num_slots):
        weights = LoraWeights(torch.randn(2, 4), torch.randn(3, 2), 0.5)
        table.install(slot, LoraAdapter(f"a{slot}", {"0": weights}, LoraConfig(r=2, lora_alpha=1)))
    return table


def test_a_step_without_adapter_rows_has_no_plan():
    assert LoraPlanner(None, torch.device("cpu")).plan([None, None], [3, 1]) is None


def test_short_segments_of_several_adapters_take_the_stacked_form_and_long_ones_the_segments():
    planner = LoraPlanner(table_with(2), torch.device("cpu"))
    assert planner.stacked_rows_per_segment == 16  # the CPU's threshold
    short = planner.plan([0, 1, None], [1, 1, 1])
    assert short.tokens == [LoraSegment(0, 0, 1), LoraSegment(1, 1, 2)]
    assert short.stack is not None and short.groups["tokens"].num_groups == 2
    long = planner.plan([0, 1], [20, 1])
    assert long.stack is None and long.tokens == [LoraSegment(0, 0, 20), LoraSegment(1, 20, 21)]
    alone = planner.plan([1, 1], [1, 1])  # one adapter: one matmul pair whatever the length
    assert alone.stack is None and alone.tokens == [LoraSegment(1, 0, 2)]
    assert not planner.per_row  # the per-row kernels are CUDA's


def test_encoder_logits_and_patch_rows_are_segments_of_their_own():
    plan = LoraPlanner(table_with(2), torch.device("cpu")).plan([1, 0], [1, 1], [1, 0], [5, 2])
    assert plan.segments("encoder") == plan.segments("states") == [LoraSegment(1, 0, 5), LoraSegment(0, 5, 7)]
    plan.set_rows("logits", [1, None], [2, 1])
    plan.set_rows("patches", [0], [3])
    assert plan.logits == [LoraSegment(1, 0, 2)] and plan.patches == [LoraSegment(0, 0, 3)]


def test_apply_adds_each_rows_own_adapter_delta():
    table = table_with(2)
    layer = table.layers["0"]
    x = torch.randn(3, 4)
    base = layer.base(x)
    for rows_per_segment in (16, 0):  # the stacked form, the segments
        planner = LoraPlanner(table, torch.device("cpu"))
        planner.stacked_rows_per_segment = rows_per_segment
        plan = planner.plan([None, 0, 1], [1, 1, 1])
        assert (plan.stack is not None) == (rows_per_segment > 0)
        got = plan.apply(base.clone(), x, layer)
        for row, slot in ((1, 0), (2, 1)):
            w = table.weights(slot)["0"]
            torch.testing.assert_close(got[row], base[row] + w.scale * (x[row] @ w.a.t()) @ w.b.t())
        assert torch.equal(got[0], base[0])


def loraplex_imports(package: pathlib.Path) -> list[tuple[str, str]]:
    """(file, module) for each loraplex module the files under `package` import."""
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [(path.name, n) for n in names if n.startswith("loraplex.")]
    return found


def test_lora_kernels_import_nothing_from_layers():
    kernels = ROOT / "lora" / "step" / "kernels"
    assert len(list(kernels.glob("*.py"))) > 3, kernels  # the rule reads real files
    offences = [(f, n) for f, n in loraplex_imports(kernels) if n.startswith("loraplex.layers")]
    assert not offences, offences


def test_the_shared_kernel_helpers_import_nothing_else_of_loraplex_but_its_switches():
    offences = [(f, n) for f, n in loraplex_imports(ROOT / "kernels")
                if not n.startswith("loraplex.kernels") and n != "loraplex.environment"]
    assert not offences, offences
