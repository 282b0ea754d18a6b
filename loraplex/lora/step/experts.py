"""LoRA on a mixture of experts' stacked linears (layers/moe.py): per (expert, adapter) group of (row, expert) pairs.

Adapters name each expert's linears one by one, as PEFT does on the per-expert module layout
(`model.layers.3.mlp.experts.5.gate_proj`; Mixtral's `block_sparse_moe.experts.5.w1` maps there, models/moe.py).
Each such name is a module of its own in the adapter table (`ExpertProjection`: its shape, a view of its base
weight), so the slots, uploads and layouts hold per-expert weights as they hold any linear's.

`LoraExperts` wraps a `MoeExperts` and hands it the step's deltas as its `ExpertTerms`: every pair (row, expert)
gets its row's adapter's delta for that expert. The experts sort the pairs by expert, stably, and the runner orders
rows by adapter, so each (expert, adapter) group is one contiguous run of pairs: one shrink and one expand per group
(`kernels.add_lora`, as for a linear's segments). The row's adapter comes from the step's plan, whatever form its
linears take (`LoraPlan.row_slots`).

PEFT 0.21 on transformers 5 writes expert LoRA on the stacked parameters instead (`target_parameters`); the adapter
loader cuts those into the same per-expert projections (lora/step/expert_slices.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex.layers.forward_context import current_lora
from loraplex.layers.moe import ExpertDispatch, MoeExperts
from loraplex.lora.step.kernels import add_lora
from loraplex.lora.step.row_maps import LoraSegment


@dataclass(frozen=True, eq=False)
class ExpertProjection:
    """One expert's linear of a stacked experts module, as the adapter table sees a LoRA target."""

    name: str  # e.g. model.layers.3.mlp.experts.5.gate_proj
    experts: MoeExperts
    expert: int
    projection: str  # gate_proj | up_proj | down_proj
    row_kind: str = "tokens"

    @property
    def in_features(self) -> int:
        return self.experts.projection_shape(self.projection)[0]

    @property
    def out_features(self) -> int:
        return self.experts.projection_shape(self.projection)[1]

    @property
    def weight(self) -> torch.Tensor:
        """The base weight [out_features, in_features] (a view of the stack)."""
        return self.experts.projection_weight(self.expert, self.projection)


class LoraExperts(nn.Module):
    """A `MoeExperts` whose products get each pair's adapter delta for the pair's expert."""

    def __init__(self, base: MoeExperts, name: str) -> None:
        super().__init__()
        self.base, self.name = base, name

    # The wrapped experts' shape and stacked weights, read through as a LoraLinear reads through to its base.
    num_experts = property(lambda self: self.base.num_experts)
    gate_up_proj = property(lambda self: self.base.gate_up_proj)
    down_proj = property(lambda self: self.base.down_proj)

    def projections(self) -> dict[str, ExpertProjection]:
        """Per-expert module name -> its projection, for every expert and projection."""
        names = [p for group in MoeExperts.PRODUCTS.values() for p in group]
        return {f"{self.name}.{e}.{p}": ExpertProjection(f"{self.name}.{e}.{p}", self.base, e, p)
                for e in range(self.base.num_experts) for p in names}

    def forward(self, x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor) -> torch.Tensor:
        plan = current_lora()
        terms = None if plan is None else ExpertDeltas(plan, self.name, x.shape[0])
        return self.base(x, top_weights, top_experts, terms)


class ExpertDeltas:
    """The `ExpertTerms` of one call: each pair's adapter delta, per (expert, adapter) run of pairs."""

    def __init__(self, plan, name: str, num_rows: int) -> None:
        self.plan, self.name, self.num_rows = plan, name, num_rows
        self._runs: dict[int, list[LoraSegment]] | None = None

    def add(self, product: str, x: torch.Tensor, out: torch.Tensor, dispatch: ExpertDispatch) -> torch.Tensor:
        projections = MoeExperts.PRODUCTS[product]
        width = out.shape[1] // len(projections)
        weights = self.plan.weights
        for expert, runs in self._expert_runs(dispatch).items():
            for i, projection in enumerate(projections):
                column = weights.get(f"{self.name}.{expert}.{projection}")
                if column is not None:
                    add_lora(out[:, i * width:(i + 1) * width], x, runs, column)
        return out

    def _expert_runs(self, dispatch: ExpertDispatch) -> dict[int, list[LoraSegment]]:
        """expert -> its runs of pairs that share an adapter (slot, start, end in the sorted pairs); pairs of
        base-model rows are in none. Computed once per call, for both products."""
        if self._runs is None:
            slots = self.plan.row_slots("tokens", self.num_rows, dispatch.rows.device)[dispatch.rows]
            runs: dict[int, list[LoraSegment]] = {}
            pairs = slots.shape[0]
            if pairs:
                key = dispatch.experts * (int(slots.max()) + 2) + slots + 1
                starts = torch.ones(pairs, dtype=torch.bool, device=key.device)
                starts[1:] = key[1:] != key[:-1]
                first = starts.nonzero().flatten()
                bounds = first.tolist() + [pairs]
                for i, (expert, slot) in enumerate(zip(dispatch.experts[first].tolist(), slots[first].tolist())):
                    if slot >= 0:
                        runs.setdefault(expert, []).append(LoraSegment(slot, bounds[i], bounds[i + 1]))
            self._runs = runs
        return self._runs
