"""LoRA-capable linears and the per-engine slot tables that feed them.

`wrap_linears` puts every `nn.Linear` of a model inside a `LoraLinear` (after the base weights are
loaded, so checkpoint names are untouched; wrapping twice is a no-op). The layers hold no adapter
state: each forward pass brings, through the forward context, which rows use which slot and the
slot tables of the engine running it. So one model can serve several engines (as tests do), and
model code never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex.layers.forward_context import current_lora_rows
from loraplex.lora.adapter import BaseShapes, LoraAdapter, LoraWeights
from loraplex.lora.kernels import add_lora, add_lora_stacked

# The output head sees the rows handed to compute_logits, not the step's token rows.
_ROW_KIND = {"lm_head": "logits"}


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.row_kind = _ROW_KIND.get(name.rsplit(".", 1)[-1], "tokens")

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = current_lora_rows()
        if rows is None:
            return out
        if rows.stack is not None:
            stacked = rows.stack.layers.get(self.name)
            if stacked is None:  # no adapter of this step targets this layer
                return out
            return add_lora_stacked(out, x, rows.masks[self.row_kind], *stacked)
        return add_lora(out, x, rows.segments(self.row_kind), rows.weights[self.name])


def wrap_linears(model: nn.Module) -> dict[str, LoraLinear]:
    """Wrap each nn.Linear of `model` in a LoraLinear (once); module name -> layer."""
    layers: dict[str, LoraLinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLinear):
            layers[name] = module
        elif isinstance(module, nn.Linear) and not name.endswith(".base"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = LoraLinear(module, name)
            setattr(parent, child, layer)
            layers[name] = layer
    return layers


class LoraSlots:
    """One engine's device slots: for each LoRA layer, the weights of the adapter in each slot."""

    def __init__(self, model: nn.Module, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_slots, self.device, self.dtype = num_slots, device, dtype
        self.layers = wrap_linears(model)
        self.tables: dict[str, list[LoraWeights | None]] = {name: [None] * num_slots for name in self.layers}
        self.occupant: list[str | None] = [None] * num_slots
        self._stack: tuple[tuple[int, ...], Stack] | None = None  # the last one built, until an install

    @property
    def base_shapes(self) -> BaseShapes:
        """module name -> (in_features, out_features): what an adapter's tensors must fit."""
        return {name: (layer.in_features, layer.out_features) for name, layer in self.layers.items()}

    def install(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (replacing whatever was there), on the model's device and dtype."""
        unknown = set(adapter.modules) - set(self.tables)
        assert not unknown, f"adapter {adapter.adapter_id} targets modules the model lacks: {sorted(unknown)[:3]}"
        for name, table in self.tables.items():
            weights = adapter.modules.get(name)
            table[slot] = None if weights is None else weights.to(self.device, self.dtype)
        self.occupant[slot] = adapter.adapter_id
        self._stack = None

    def stack(self, slots: tuple[int, ...]) -> "Stack":
        """The adapters in `slots` stacked per layer, each given a block of columns as wide as its
        largest rank (zero-padded where a module's rank is smaller or absent). Kept while unchanged."""
        if self._stack is not None and self._stack[0] == slots:
            return self._stack[1]
        widths = [max((t[s].rank for t in self.tables.values() if t[s] is not None), default=0) for s in slots]
        offsets, start = {}, 0
        for slot, width in zip(slots, widths):
            offsets[slot] = (start, width)
            start += width
        layers = {}
        for name, table in self.tables.items():
            if all(table[slot] is None for slot in slots):
                continue  # no delta here: skipping it beats multiplying through zeros every step
            layer = self.layers[name]
            a_stack = torch.zeros(start, layer.in_features, device=self.device, dtype=self.dtype)
            b_stack = torch.zeros(layer.out_features, start, device=self.device, dtype=self.dtype)
            for slot in slots:
                weights = table[slot]
                if weights is not None:
                    first = offsets[slot][0]
                    a_stack[first : first + weights.rank] = weights.a
                    b_stack[:, first : first + weights.rank] = weights.b * weights.scale
            layers[name] = (a_stack, b_stack)
        stack = Stack(offsets, start, layers)
        self._stack = (slots, stack)
        return stack


@dataclass
class Stack:
    """Several slots' adapters side by side: slot -> (first column, width), and per layer (A, B) for the
    layers at least one of them targets."""

    offsets: dict[int, tuple[int, int]]
    width: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def mask(self, segments, num_rows: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[num_rows, width] with ones where a row's adapter has its columns."""
        mask = torch.zeros(num_rows, self.width, dtype=dtype)
        for segment in segments:
            first, width = self.offsets[segment.slot]
            mask[segment.start : segment.end, first : first + width] = 1
        return mask.to(device)
