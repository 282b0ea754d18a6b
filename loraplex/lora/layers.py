"""LoRA-capable linears and the per-engine slot tables that feed them.

`wrap_linears` puts every `nn.Linear` of a model inside a `LoraLinear` (after the base weights are
loaded, so checkpoint names are untouched; wrapping twice is a no-op). The layers hold no adapter
state: each forward pass brings, through the forward context, which rows use which slot and the
slot tables of the engine running it. So one model can serve several engines (as tests do), and
model code never changes.

A quantized base (bitsandbytes' Linear8bitLt / Linear4bit, put in by `loraplex.quantization` before the
wrappers go on) is wrapped the same way: both are `nn.Linear` subclasses with the real in/out features. The
adapter delta is computed from the layer's input in its dtype (the model's compute dtype, the dtype the slot
tables hold) and added to the base output, cast to that dtype if the base returned another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from loraplex.layers.forward_context import LoraGroups, LoraRowSlots, LoraSegment, current_lora_rows
from loraplex.lora.adapter import BaseShapes, LoraAdapter, LoraWeights
from loraplex.lora.beside import ShrinkBeside, in_graph, shrink_beside
from loraplex.lora.kernels import SlotPointers, add_lora, add_lora_stacked
from loraplex.lora.upload import AdapterUploader, Uploaded
from loraplex.lora.staging import StagedUploads
from loraplex.quantization import dequantized_weight

# Which rows a LoRA-wrapped linear sees (DESIGN.md 7), by its module path: the output head sees the rows
# handed to compute_logits; a vision tower and its projector see images (LLaVA: tiles; Mllama: whole
# images), each owned by the request whose image it is; an encoder-decoder's encoder sees the encoder rows
# of the requests it runs for; cross-attention key/value projections see the states they read (an
# encoder's output, Mllama's image states), each request's own (`states`); everything else sees the
# step's token rows.
_IMAGE_MODULES = ("vision_tower.", "vision_model.", "multi_modal_projector")
_STATE_MODULES = (
    "EncDecAttention.k", "EncDecAttention.v", "encoder_attn.k_proj", "encoder_attn.v_proj",  # T5, BART
    "cross_attn.k_proj", "cross_attn.v_proj",  # Mllama
)
_ENCODER_STACKS = ("encoder", "model.encoder")  # T5's and BART's encoder stacks


def row_kind(name: str) -> str:
    if name.rsplit(".", 1)[-1] == "lm_head":
        return "logits"
    if any(part in name for part in _IMAGE_MODULES):
        return "patches"
    if name.endswith(_STATE_MODULES):
        return "states"
    if any(name.startswith(stack + ".") for stack in _ENCODER_STACKS):
        return "encoder"
    return "tokens"


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.row_kind = row_kind(name)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The base weight [out_features, in_features] as floats (a quantized base's, dequantized)."""
        return dequantized_weight(self.base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        early = self.begin_siblings([self], x, (self.out_features,))
        out = self.base(x)
        if early is not None:
            early.expand([out])
            return out
        return self.add_to(out, x)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The base output `out` for input `x` plus each row's adapter delta (in place where the dtypes allow).
        Called by `forward`, and by `layers.projections.project` with this layer's slice of a fused product."""
        if out.dtype != x.dtype:  # a quantized base may compute in another dtype: deltas add in x's
            out = out.to(x.dtype)
        rows = current_lora_rows()
        if rows is None:
            return out
        if rows.dtype is not None and x.dtype != rows.dtype:  # e.g. T5's float32 `wo` in a bfloat16 model
            delta = self._add(torch.zeros(out.shape, dtype=rows.dtype, device=out.device), x.to(rows.dtype), rows)
            return out + delta.to(out.dtype)
        return self._add(out, x, rows)

    @staticmethod
    def begin_siblings(layers: Sequence["LoraLinear"], x: torch.Tensor, sizes: Sequence[int]) -> ShrinkBeside | None:
        """Before the base product of `layers` (its columns: each layer's `sizes` in order), the work of their
        deltas that can start without it: in a CUDA graph (`beside.in_graph`), where the step takes the per-row
        kernels for all of them, the shrink goes beside the product (`beside.py`). The caller then passes all the
        product's outputs to the result's `expand` instead of `add_to`/`add_siblings_to`. None: nothing started."""
        per_row = _per_row_slots(layers, x)  # first: the cheapest test, and None in most eager steps
        if (per_row is None or per_row.tiles is not None or x.dim() != 2 or not in_graph(x)
                or any(not _plain_in(layer, x.dtype) for layer in layers)):
            return None
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        targeted = [(i, layer.name, start, size) for i, (layer, start, size) in enumerate(zip(layers, starts, sizes))
                    if layer.name in per_row.layers]
        if not targeted:
            return None
        positions, names, offsets, widths = zip(*targeted)
        return shrink_beside(offsets, widths, x, per_row.slots, per_row.tables, names, per_row.max_rank, positions)

    @staticmethod
    def add_siblings_to(layers: Sequence["LoraLinear"], outs: Sequence[torch.Tensor], x: torch.Tensor,
                        early: ShrinkBeside | None = None) -> tuple:
        """`add_to` for sibling layers that share the input `x` and whose outputs `outs` are column slices of one
        fused product (`layers.projections.project`): where the step takes the per-row kernels for all of them,
        their deltas come in one pair of launches instead of a pair each. `early`: `begin_siblings`' shrink."""
        if early is not None:
            early.expand(outs)
            return tuple(outs)
        per_row = _per_row_slots(layers, x)
        if per_row is None or any(o.dtype != x.dtype for o in outs):
            return tuple(layer.add_to(out, x) for layer, out in zip(layers, outs))
        targeted = [(layer.name, out) for layer, out in zip(layers, outs) if layer.name in per_row.layers]
        if targeted:
            names, targeted_outs = zip(*targeted)
            _add_per_row(targeted_outs, x, per_row, names)
        return tuple(outs)

    def _add(self, out: torch.Tensor, x: torch.Tensor, rows) -> torch.Tensor:
        """`out` plus, row by row, the delta of the row's own adapter (in place)."""
        per_row = rows.row_slots.get(self.row_kind)
        if per_row is not None:  # the per-row form's rows; segments left beside it (if any) as segments
            if self.name in per_row.layers:
                _add_per_row([out], x, per_row, [self.name])
            segments = rows.segments(self.row_kind)
            return add_lora(out, x, segments, rows.weights[self.name]) if segments else out
        groups = rows.groups.get(self.row_kind) if rows.stack is not None else None
        if groups is not None:
            stacked = rows.stack.layers.get(self.name)
            if stacked is None:  # no adapter of this step targets this layer
                return out
            return add_lora_stacked(out, x, groups, *stacked)
        segments = rows.segments(self.row_kind)
        if x.dim() == 3:  # [items, seq, features] (image tiles): a segment covers whole items
            seq = x.shape[1]
            flat = [LoraSegment(s.slot, s.start * seq, s.end * seq) for s in segments]
            add_lora(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), flat, rows.weights[self.name])
            return out
        return add_lora(out, x, segments, rows.weights[self.name])


def _per_row_slots(layers: Sequence[LoraLinear], x: torch.Tensor) -> LoraRowSlots | None:
    """The per-row form's slots where the step takes it for every one of `layers` on x (one row kind, no segments
    beside it, x in the adapters' dtype), else None."""
    rows = current_lora_rows()
    kind = layers[0].row_kind
    per_row = rows.row_slots.get(kind) if rows is not None else None
    if (per_row is None or rows.segments(kind) or any(layer.row_kind != kind for layer in layers)
            or (rows.dtype is not None and x.dtype != rows.dtype)):
        return None
    return per_row


def _plain_in(layer: LoraLinear, dtype: torch.dtype) -> bool:
    """Whether the layer's base is a plain linear whose product comes out in `dtype` (a quantized base's may
    not: its deltas take `add_to`'s path)."""
    return type(layer.base) is nn.Linear and layer.base.weight.dtype == dtype


def _add_per_row(outs: Sequence[torch.Tensor], x: torch.Tensor, per_row, names: Sequence[str]) -> None:
    """outs[g] += each row's delta of layer names[g] (sibling layers sharing the input x), in the per-row form's
    tiles when it has them, else row by row."""
    if per_row.tiles is not None:
        from loraplex.lora.kernels.sgmv import add_lora_tiles_siblings  # Triton: CUDA only

        add_lora_tiles_siblings(outs, x, per_row.tiles, per_row.tables, names, per_row.max_rank)
    else:
        from loraplex.lora.kernels.bgmv import add_lora_rows_siblings  # Triton: CUDA only

        add_lora_rows_siblings(outs, x, per_row.slots, per_row.tables, names, per_row.max_rank)


def wrap_linears(model: nn.Module) -> dict[str, LoraLinear]:
    """Wrap each nn.Linear of `model` (bitsandbytes' quantized linears included) in a LoraLinear (once);
    module name -> layer."""
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

    def __init__(self, model: nn.Module, num_slots: int, device: torch.device, dtype: torch.dtype, max_rank: int = 64) -> None:
        self.num_slots, self.device, self.dtype, self.max_rank = num_slots, device, dtype, max_rank
        self.layers = wrap_linears(model)
        # Each slot's adapter as uploaded, and its per-module views once some form of the kernels asked for them.
        self._uploads: list[Uploaded | None] = [None] * num_slots
        self._views: list[dict[str, LoraWeights] | None] = [None] * num_slots
        self.tables = {name: SlotColumn(self, name) for name in self.layers}
        self.occupant: list[str | None] = [None] * num_slots
        # Where each slot's weights live, for the per-row kernels (kept in step with the uploads by `install`).
        self.pointers = SlotPointers(list(self.layers), num_slots, device)
        self._uploader = AdapterUploader(device, dtype)
        self._staged = StagedUploads(self._uploader)
        self._stack: tuple[tuple[int, ...], Stack] | None = None  # the last one built, until an install

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
        self._stack = None

    def installs(self):
        """A context for a step's installs: the slot tables reach the device once, at its end."""
        return self.pointers.deferred()

    def stage_ahead(self, adapters: Iterable[LoraAdapter]) -> None:
        """Lay out, on a worker thread, the adapters to be installed next (in that order, read only as far as the
        staging budget reaches; lora/staging.py)."""
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
        self._stack = None

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
        the 420 views of a 135M model's adapter cost ~1 ms of host time per install otherwise."""
        uploaded = self._uploads[slot]
        if uploaded is None or name not in uploaded.layout.entries:
            return None
        return self.weights(slot)[name]

    def stack(self, slots: tuple[int, ...]) -> "Stack":
        """The adapters in `slots` stacked per layer: A [G, R, in] and B [G, out, R] with the scale folded
        into B and ranks zero-padded to the largest R among them (zeros where a slot's adapter does not
        target the layer). Kept while unchanged."""
        if self._stack is not None and self._stack[0] == slots:
            return self._stack[1]
        rank = max((t[s].rank for t in self.tables.values() for s in slots if t[s] is not None), default=0)
        layers = {}
        for name, table in self.tables.items():
            if all(table[slot] is None for slot in slots):
                continue  # no delta here: skipping it beats multiplying through zeros every step
            layer = self.layers[name]
            a_stack = torch.zeros(len(slots), rank, layer.in_features, device=self.device, dtype=self.dtype)
            b_stack = torch.zeros(len(slots), layer.out_features, rank, device=self.device, dtype=self.dtype)
            for group, slot in enumerate(slots):
                weights = table[slot]
                if weights is not None:
                    a_stack[group, : weights.rank] = weights.a
                    b_stack[group, :, : weights.rank] = weights.b * weights.scale
            layers[name] = (a_stack, b_stack)
        stack = Stack({slot: group for group, slot in enumerate(slots)}, layers)
        self._stack = (slots, stack)
        return stack


class SlotColumn:
    """One layer's weights in each slot (`column[slot]`: None where the slot's adapter does not target the layer),
    as the segment and stacked forms read them."""

    def __init__(self, slots: LoraSlots, name: str) -> None:
        self._slots, self._name = slots, name

    def __getitem__(self, slot: int) -> LoraWeights | None:
        return self._slots.module_weights(slot, self._name)


@dataclass
class Stack:
    """Several slots' adapters stacked: slot -> its group, and per layer (A, B) for the layers at least
    one of them targets."""

    group_of: dict[int, int]
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def groups(self, segments: Sequence[LoraSegment], device: torch.device) -> LoraGroups:
        """How the rows of `segments` (contiguous, each of a slot in the stack) fill the stack's groups."""
        assert segments, "no rows use an adapter"
        start, end = segments[0].start, segments[-1].end
        per_group = [0] * len(self.group_of)
        for segment in segments:
            per_group[self.group_of[segment.slot]] += segment.end - segment.start
        rows_per_group = max(per_group)
        # Positions no row fills (short or empty groups) compute on row `start`; nothing reads them back.
        gather = [start] * (len(per_group) * rows_per_group)
        scatter: list[int] = []
        filled = [0] * len(per_group)
        previous_end = start
        for segment in segments:
            assert segment.start == previous_end, "adapter rows must be contiguous (the runner sorts them)"
            previous_end = segment.end
            group = self.group_of[segment.slot]
            for row in range(segment.start, segment.end):
                position = group * rows_per_group + filled[group]
                gather[position] = row
                scatter.append(position)
                filled[group] += 1
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return LoraGroups(start, end, len(per_group), rows_per_group, as_tensor(gather), as_tensor(scatter))
