"""One engine's adapter weights on the device, by slot: the uploads, the per-row kernels' pointer table, and the
stacked form's stacks.

`AdapterTable` wraps the model's linears (lora/step/layers.py) and holds, per device slot, the adapter the scheduler put
there. The layers hold no adapter state: each step's plan (plan.py) reads this table, so one model can serve several
engines (as tests do).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from loraplex.lora.adapter import BaseShapes, LoraAdapter, LoraWeights
from loraplex.lora.step.kernels import PointerTable
from loraplex.lora.step.layers import wrap_linears
from loraplex.lora.device.stacks import SlotStacks, Stack
from loraplex.lora.device.staging import StagedUploads
from loraplex.lora.device.upload import AdapterUploader, Uploaded


class AdapterTable:
    """One engine's device table: for each LoRA layer, the weights of the adapter in each device slot (which
    adapter gets which slot is the scheduler's `AdapterResidency`)."""

    def __init__(self, model: nn.Module, num_slots: int, device: torch.device, dtype: torch.dtype, max_rank: int = 64) -> None:
        self.num_slots, self.device, self.dtype, self.max_rank = num_slots, device, dtype, max_rank
        self.layers = wrap_linears(model)
        # Each slot's adapter as uploaded, and its per-module views once some form of the kernels asked for them.
        self._uploads: list[Uploaded | None] = [None] * num_slots
        self._views: list[dict[str, LoraWeights] | None] = [None] * num_slots
        self.columns = {name: LayerColumn(self, name) for name in self.layers}
        self.occupant: list[str | None] = [None] * num_slots
        # Where each slot's weights live, for the per-row kernels (kept in step with the uploads by `install`).
        self.pointers = PointerTable(list(self.layers), num_slots, device)
        self._uploader = AdapterUploader(device, dtype)
        self._staged = StagedUploads(self._uploader)
        self._stacks = SlotStacks(self)  # the stacked form's weights, kept across steps

    @property
    def base_shapes(self) -> BaseShapes:
        """module name -> (in_features, out_features): what an adapter's tensors must fit."""
        return {name: (layer.in_features, layer.out_features) for name, layer in self.layers.items()}

    def install(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (replacing whatever was there), on the model's device and dtype."""
        unknown = adapter.modules.keys() - self.layers.keys()
        assert not unknown, f"adapter {adapter.adapter_id} targets modules the model lacks: {sorted(unknown)[:3]}"
        assert adapter.max_rank <= self.max_rank, f"adapter {adapter.adapter_id} has rank {adapter.max_rank} > {self.max_rank}"
        staged = self._staged.take(adapter)
        uploaded = self._uploader.upload(adapter.modules, adapter.flat, adapter.layout, staged)
        self._uploads[slot], self._views[slot] = uploaded, None
        self.pointers.set_slot_uploaded(slot, uploaded)
        self.occupant[slot] = adapter.key
        self._stacks.changed(slot)

    def installs(self):
        """A context for a step's installs: the pointer table reaches the device once, at its end."""
        return self.pointers.deferred()

    def stage_ahead(self, adapters: Iterable[LoraAdapter]) -> None:
        """Lay out, on a worker thread, the adapters to be installed next (in that order, read only as far as the
        staging budget reaches; lora/device/staging.py)."""
        self._staged.want(adapters)

    @property
    def staged(self) -> list[str]:
        """Keys of the adapters staged ahead."""
        return self._staged.staged_keys

    def clear(self, slot: int) -> None:
        """Empty `slot` (after an install that failed part way): no layer holds weights for it."""
        self._uploads[slot], self._views[slot] = None, None
        self.pointers.set_slot(slot, {})
        self.occupant[slot] = None
        self._stacks.changed(slot)

    def weights(self, slot: int) -> dict[str, LoraWeights]:
        """module name -> the weights of the adapter in `slot` (empty: none), as views of its upload."""
        views = self._views[slot]
        if views is None:
            uploaded = self._uploads[slot]
            views = self._views[slot] = uploaded.weights() if uploaded is not None else {}
        return views

    def module_weights(self, slot: int, name: str) -> LoraWeights | None:
        """Layer `name`'s weights in `slot` (None: its adapter does not target the layer). The slot's views are made
        only when it does: every eager step asks for the head's (the logits rows), which adapters seldom target, and
        making the hundreds of views of an adapter costs each install host time otherwise."""
        uploaded = self._uploads[slot]
        if uploaded is None or name not in uploaded.layout.entries:
            return None
        return self.weights(slot)[name]

    def stack(self, slots: tuple[int, ...]) -> Stack:
        """The adapters in `slots` stacked per layer for the stacked form (lora/device/stacks.py: kept across steps,
        each slot written when it joins)."""
        return self._stacks.for_slots(slots)


class LayerColumn:
    """One layer's weights in each slot (`column[slot]`: None where the slot's adapter does not target the layer),
    as the segment and stacked forms read them."""

    def __init__(self, table: AdapterTable, name: str) -> None:
        self._table, self._name = table, name

    def __getitem__(self, slot: int) -> LoraWeights | None:
        return self._table.module_weights(slot, self._name)
