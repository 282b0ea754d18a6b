"""The per-step LoRA plan: which rows use which adapter, in which form the kernels take them, and the one `apply`
that adds a layer's deltas whatever that form is (as vLLM's Punica wrapper does).

`LoraPlanner.plan` builds a step's plan from its rows and their adapter slots; the runner hands it to the layers
through the forward context (`ForwardContext.lora`, opaque to layers/), and each `LoraLinear` asks it for its
deltas. The planner is the one place that picks a form, for eager steps (`plan`) and for CUDA graphs'
decode steps (`graph_plan`). The forms, per kind of row (which rows a linear reads: `lora/step/layers.py` `row_kind`,
from its model family's `linear_rows`):

- segments: one matmul pair per adapter's run of rows (`kernels/segments.py`); prefill, and every kind of row
  but the step's tokens;
- stacked: the step's adapters stacked, two batched matmuls per layer (`kernels/segments.py`); many short
  segments (decode) off CUDA;
- per row: each row names its slot and the kernels find the weights through the pointer table
  (`kernels/rows.py`, `bgmv.py`), or the rows come in tiles of one adapter (`kernels/tiles.py`, `sgmv.py`); on
  CUDA for the rows of several adapters, and in CUDA graphs, where the shrink of sibling projections may run beside
  their base product (`beside.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from loraplex.kernels import triton_available
from loraplex.lora.step.beside import ShrinkBeside, in_graph, shrink_beside
from loraplex.lora.step.kernels import add_lora, add_lora_stacked
from loraplex.lora.step.kernels.tiles import lora_tiles
from loraplex.lora.step.row_maps import LoraGroups, LoraSegment, LoraTiles, lora_segments

if TYPE_CHECKING:
    from loraplex.lora.step.layers import LoraLinear
    from loraplex.lora.device.table import AdapterTable

# Steps whose adapter segments have at most this many rows each use the stacked LoRA form (each
# adapter's rows padded to the longest segment, two batched matmuls per module). On a GPU each small
# matmul of the segmented form costs a launch; on a CPU, a Python call and a small BLAS call.
# `python -m benchmarks.lora_kernels` measures both forms.
STACKED_ROWS_PER_SEGMENT = {"cuda": 64, "cpu": 16}

# The kinds of row whose adapters are set after the plan is built, before the call that sees them.
_LATE_KINDS = ("logits", "patches")


@dataclass
class PerRowForm:
    """The per-row LoRA form (lora/step/kernels/rows.py): each row's slot, -1 for none (`slots` [T] int32), the
    engine's pointer table (a `PointerTable`) and the layers some slot's adapter targets (the others add nothing).
    With `tiles` (eager steps, where prompts' rows share their adapter) the kernels take the tiles instead of
    `slots`, which is then None."""

    slots: torch.Tensor | None
    pointers: Any
    layers: frozenset[str]
    max_rank: int
    tiles: LoraTiles | None = None
    segments: list[LoraSegment] = field(default_factory=list)  # with `tiles`: the rows' segments (`row_slots`)


@dataclass
class LoraPlan:
    """Which rows use which adapter, per kind of row a LoRA-wrapped linear sees, and in which form.

    Rows are ordered by adapter (the runner sorts sequences so), so each adapter owns one contiguous
    segment; rows of the base model are in no segment. `tokens` covers the step's token rows; `logits`
    covers the rows handed to `compute_logits` and is set (`set_rows`) before each such call.
    """

    tokens: list[LoraSegment]
    logits: list[LoraSegment]
    weights: Mapping[str, Sequence[Any]]  # LoRA layer name -> the weights in each slot (None: no delta)
    # Image tiles seen by a vision tower and its projector, in units of tiles (the first dimension of
    # their [tiles, seq, features] inputs); set before a step's images are encoded.
    patches: list[LoraSegment] = field(default_factory=list)
    # Encoder-decoder models: the rows of the encoders that run this step, each request's rows using its
    # adapter; `states` (the cross-attention key/value projections of the encoder's output) sees the
    # same rows in the same order.
    encoder: list[LoraSegment] = field(default_factory=list)
    # For steps of many short segments: the step's adapters stacked (a lora `Stack`: per layer its A
    # and B stacks, only for layers some adapter targets), and per row kind how rows map onto the
    # stack's groups. None: use the segments.
    stack: Any = None
    groups: dict[str, LoraGroups] = field(default_factory=dict)
    # On CUDA, for steps of short segments (decode) and CUDA graphs: per row kind, the per-row form (which takes
    # precedence over the stack and the segments).
    per_row: dict[str, PerRowForm] = field(default_factory=dict)
    # The dtype the adapter weights hold (the model's compute dtype); an input in another dtype (a layer
    # kept in float32) has its delta computed in this one. None: the input's dtype.
    dtype: torch.dtype | None = None
    _row_slots: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def segments(self, kind: str) -> list[LoraSegment]:
        if kind == "states":
            return self.encoder
        return {"tokens": self.tokens, "logits": self.logits, "patches": self.patches, "encoder": self.encoder}[kind]

    def set_rows(self, kind: str, slots: list[int | None], row_counts: list[int]) -> None:
        """Before a call that sees rows of `kind` ("logits": compute_logits; "patches": an image encoder): row i's
        run of `row_counts[i]` rows uses slot `slots[i]`. Always as segments: the logits rows are few and the head
        is wide, so the stacked form's padded [groups, rows, vocab] product would cost more than one small matmul
        pair per adapter; images are few."""
        assert kind in _LATE_KINDS, kind
        setattr(self, kind, lora_segments(slots, row_counts))
        self._row_slots = {key: value for key, value in self._row_slots.items() if key[0] != kind}

    def row_slots(self, kind: str, rows: int, device: torch.device) -> torch.Tensor:
        """Each of the `rows` rows of `kind`: its adapter's slot, -1 for none, [rows] int64 on `device`, whatever
        form the linears take (the experts group their (row, expert) pairs by it: lora/step/experts.py)."""
        cached = self._row_slots.get((kind, rows))
        if cached is not None:
            return cached
        per_row = self.per_row.get(kind)
        if per_row is not None and per_row.slots is not None:
            slots = per_row.slots.to(device, torch.int64)
        else:
            slots = torch.full((rows,), -1, dtype=torch.int64)
            for segment in [*self.segments(kind), *(per_row.segments if per_row is not None else ())]:
                slots[segment.start:segment.end] = segment.slot
            slots = slots.to(device)
        self._row_slots[(kind, rows)] = slots
        return slots

    # ---- the deltas ------------------------------------------------------------------------------------------

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: LoraLinear) -> torch.Tensor:
        """`layer`'s base output `out` for input `x` plus each row's adapter delta (in place where the dtypes
        allow)."""
        if out.dtype != x.dtype:  # a quantized base may compute in another dtype: deltas add in x's
            out = out.to(x.dtype)
        if self.dtype is not None and x.dtype != self.dtype:  # e.g. T5's float32 `wo` in a bfloat16 model
            delta = self._add(torch.zeros(out.shape, dtype=self.dtype, device=out.device), x.to(self.dtype), layer)
            return out + delta.to(out.dtype)
        return self._add(out, x, layer)

    def add_to_product(self, layers: Sequence[LoraLinear], x: torch.Tensor, sizes: Sequence[int],
                       product: Callable[[], Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """The outputs of sibling `layers` (linears that read the same input x; one layer alone too) plus their
        deltas: `product()` computes their base outputs (each layer's `sizes` columns of one product, in order).
        Where it can, the work that needs only x starts before the product (`begin_siblings`), and all the
        siblings' deltas come in one pair of launches instead of a pair each."""
        early = self.begin_siblings(layers, x, sizes)
        outs = product()
        if early is not None:
            early.expand(outs)
            return tuple(outs)
        return self.add_siblings(layers, outs, x)

    def begin_siblings(self, layers: Sequence[LoraLinear], x: torch.Tensor,
                       sizes: Sequence[int]) -> ShrinkBeside | None:
        """Before the base product of `layers` (its columns: each layer's `sizes` in order), the work of their
        deltas that can start without it: in a CUDA graph (`beside.in_graph`), where the step takes the per-row
        kernels for all of them, the shrink goes beside the product (`beside.py`); its `expand` then takes all the
        product's outputs. None: nothing started."""
        per_row = self._per_row_for(layers, x)  # first: the cheapest test, and None in most eager steps
        if (per_row is None or per_row.tiles is not None or x.dim() != 2 or not in_graph(x)
                or any(not _plain_in(layer, x.dtype) for layer in layers)):
            return None
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        targeted = [(i, layer.name, start, size) for i, (layer, start, size) in enumerate(zip(layers, starts, sizes))
                    if layer.name in per_row.layers]
        if not targeted:
            return None
        positions, names, offsets, widths = zip(*targeted)
        return shrink_beside(offsets, widths, x, per_row.slots, per_row.pointers, names, per_row.max_rank, positions)

    def add_siblings(self, layers: Sequence[LoraLinear], outs: Sequence[torch.Tensor],
                     x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each of `layers`' base output plus its deltas: where the step takes the per-row kernels for all of them,
        in one pair of launches; else one layer at a time (`apply`)."""
        per_row = self._per_row_for(layers, x)
        if per_row is None or any(o.dtype != x.dtype for o in outs):
            return tuple(self.apply(out, x, layer) for layer, out in zip(layers, outs))
        targeted = [(layer.name, out) for layer, out in zip(layers, outs) if layer.name in per_row.layers]
        if targeted:
            names, targeted_outs = zip(*targeted)
            _add_per_row(targeted_outs, x, per_row, names)
        return tuple(outs)

    def _add(self, out: torch.Tensor, x: torch.Tensor, layer: LoraLinear) -> torch.Tensor:
        """`out` plus, row by row, the delta of the row's own adapter (in place)."""
        kind, name = layer.row_kind, layer.name
        per_row = self.per_row.get(kind)
        if per_row is not None:  # the per-row form's rows; segments left beside it (if any) as segments
            if name in per_row.layers:
                _add_per_row([out], x, per_row, [name])
            segments = self.segments(kind)
            return add_lora(out, x, segments, self.weights[name]) if segments else out
        groups = self.groups.get(kind) if self.stack is not None else None
        if groups is not None:
            stacked = self.stack.layers.get(name)
            if stacked is None:  # no adapter of this step targets this layer
                return out
            return add_lora_stacked(out, x, groups, *stacked)
        segments = self.segments(kind)
        if x.dim() == 3:  # [items, seq, features] (image tiles): a segment covers whole items
            seq = x.shape[1]
            flat = [LoraSegment(s.slot, s.start * seq, s.end * seq) for s in segments]
            add_lora(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), flat, self.weights[name])
            return out
        return add_lora(out, x, segments, self.weights[name])

    def _per_row_for(self, layers: Sequence[LoraLinear], x: torch.Tensor) -> PerRowForm | None:
        """The per-row form where the step takes it for every one of `layers` on x (one row kind, no segments
        beside it, x in the adapters' dtype), else None."""
        kind = layers[0].row_kind
        per_row = self.per_row.get(kind)
        if (per_row is None or self.segments(kind) or any(layer.row_kind != kind for layer in layers)
                or (self.dtype is not None and x.dtype != self.dtype)):
            return None
        return per_row


def _plain_in(layer: LoraLinear, dtype: torch.dtype) -> bool:
    """Whether the layer's base is a plain linear whose product comes out in `dtype` (a quantized base's may
    not: its deltas take `apply`'s path)."""
    return type(layer.base) is nn.Linear and layer.base.weight.dtype == dtype


def _add_per_row(outs: Sequence[torch.Tensor], x: torch.Tensor, per_row: PerRowForm, names: Sequence[str]) -> None:
    """outs[g] += each row's delta of layer names[g] (sibling layers sharing the input x), in the per-row form's
    tiles when it has them, else row by row."""
    if per_row.tiles is not None:
        from loraplex.lora.step.kernels.sgmv import add_lora_tiles_siblings  # Triton: CUDA only

        add_lora_tiles_siblings(outs, x, per_row.tiles, per_row.pointers, names, per_row.max_rank)
    else:
        from loraplex.lora.step.kernels.bgmv import add_lora_rows_siblings  # Triton: CUDA only

        add_lora_rows_siblings(outs, x, per_row.slots, per_row.pointers, names, per_row.max_rank)


# ---- building a step's plan ----------------------------------------------------------------------------------


class LoraPlanner:
    """Builds each step's plan over one engine's adapter table (None: the engine serves no adapters)."""

    def __init__(self, table: AdapterTable | None, device: torch.device) -> None:
        self.table, self.device = table, device
        # On CUDA, the rows of several adapters take the tile kernels rather than the stacked or segmented forms.
        self.per_row = table is not None and triton_available(device)
        # Off CUDA (or for one adapter's rows): segments of at most this many rows each take the stacked form.
        self.stacked_rows_per_segment = STACKED_ROWS_PER_SEGMENT.get(device.type, 8)

    def plan(self, slots: Sequence[int | None], row_counts: Sequence[int],
             encoder_slots: Sequence[int | None] = (), encoder_counts: Sequence[int] = ()) -> LoraPlan | None:
        """The plan of an eager step whose sequence i has `row_counts[i]` token rows using slot `slots[i]` (None: no
        adapter), and whose encoders (encoder-decoder models) run for `encoder_counts` rows using `encoder_slots`.
        None: no token row uses an adapter.

        On CUDA, the rows of several adapters take the tile kernels (lora/step/kernels/tiles.py): one launch pair per
        module (q/k/v and gate/up as one) for all of them, each adapter read once per tile of its rows. One
        adapter's rows keep a matmul pair per module: the tiles cost the one-adapter online run's eager steps more
        (docs/benchmarks.md). Elsewhere many short segments (decode, at most `stacked_rows_per_segment` rows each)
        use the stacked form: two matmuls per module for all adapters at once instead of two per adapter; long
        segments (prefill) keep one pair each.
        """
        segments = lora_segments(list(slots), list(row_counts))
        if not segments:
            return None
        table = self.table
        assert table is not None, "a request has an adapter slot but the runner has no adapter table"
        plan = LoraPlan(tokens=segments, logits=[], weights=table.columns, dtype=table.dtype)
        if encoder_counts:  # encoder rows (and the states made from them) by request
            plan.encoder = lora_segments(list(encoder_slots), list(encoder_counts))
        if self.per_row and len(segments) > 1:
            plan.per_row["tokens"] = PerRowForm(None, table.pointers, table.pointers.targeted, table.max_rank,
                                                tiles=lora_tiles(segments, self.device), segments=segments)
            plan.tokens = []
            return plan
        # Each adapter's group is padded to the longest: cap the longest, which bounds the padding.
        if len(segments) > 1 and max(s.end - s.start for s in segments) <= self.stacked_rows_per_segment:
            plan.stack = table.stack(tuple(sorted({s.slot for s in segments})))
            plan.groups["tokens"] = plan.stack.groups(segments, self.device)
        return plan

    def graph_plan(self, row_slots: torch.Tensor, layers: frozenset[str]) -> LoraPlan:
        """The plan of a CUDA graph's decode step: every token and logits row in the per-row form, each row's slot
        read from `row_slots` [T] int32 on the device (-1: none) at replay; `layers`: those some installed adapter
        targets."""
        table = self.table
        assert table is not None, "a graph with adapters but no adapter table"
        per_row = PerRowForm(row_slots, table.pointers, layers, table.max_rank)
        return LoraPlan(tokens=[], logits=[], weights=table.columns, dtype=table.dtype,
                        per_row={"tokens": per_row, "logits": per_row})
