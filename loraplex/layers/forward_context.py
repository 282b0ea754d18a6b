"""The per-step forward context: what the runner knows about the batch that some layers need.

The runner sets it with `with forward_context(ctx):` around one forward pass; attention and LoRA
layers read it. Model code never sees it, so model `forward` signatures stay those of a plain model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch


@dataclass
class DecodeGroup:
    """Decode sequences attended together: padded to the group's longest, so lengths are kept close."""

    seqs: torch.Tensor  # [G] int64 sequence indices
    rows: torch.Tensor  # [G] int64 token rows
    seq_lens: torch.Tensor  # [G] int64
    max_len: int
    # Every sequence of the step, in order (seqs == rows == 0..G-1): the block tables need no gather.
    in_order: bool = False


@dataclass
class EncoderMetadata:
    """The states cross-attention reads: an encoder-decoder's encoder output, or a vision model's image
    states (Mllama). Present in a step where at least one sequence has states.

    State rows made this step: the concatenated states of the requests that start (each request's rows
    contiguous: `query_start_loc` [E + 1]; an encoder-decoder's encoder rows); their cross-attention keys
    and values are written at `slot_mapping` in every cross layer's cache. Sequence s reads `lens[s]`
    states from the blocks of `block_tables[s]` (per-request blocks of the same KV cache, so they are
    allocated and counted like the sequence's own); `lens[s]` 0: it has none (a text-only request in a
    vision model's step), its rows' cross-attention output is zero.
    """

    query_start_loc: list[int]
    slot_mapping: torch.Tensor  # [E rows] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    lens: list[int]  # [B] number of states of each of the step's sequences
    # The decode sequences (one row each) that have states, in groups of similar count; a group's
    # `seq_lens` are state counts. The other sequences with states are the step's `prefill_seqs`.
    decode_groups: list[DecodeGroup]
    # Per token row, the states it sees: [row_first, row_end) of its sequence's (None: all of them).
    row_first: torch.Tensor | None = None  # [T] int64
    row_end: torch.Tensor | None = None  # [T] int64
    # Per token row, whether it sees any state (None: every row does). Rows that do not get no output from
    # a cross layer, attention or feed-forward (Mllama's rows before a request's first image, text-only
    # requests).
    rows_seeing: torch.Tensor | None = None  # [T] bool


@dataclass
class AttentionMetadata:
    """Flat description of one step's sequences. Tensors live on the model's device.

    Tokens of all sequences are concatenated: sequence `s` owns rows
    `query_start_loc[s] : query_start_loc[s + 1]` and has `seq_lens[s]` tokens in total after this
    step (context already cached + new rows).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    seq_lens: list[int]  # per sequence, context + new
    query_start_loc: list[int]  # [B + 1]
    # Sequences that compute exactly one token (decode rows), batched in groups of similar length.
    decode_groups: list["DecodeGroup"]
    prefill_seqs: list[int]  # the other sequences, handled one by one
    encoder: EncoderMetadata | None = None  # encoder-decoder models only
    # What a backend computes once per step for all layers (a stack's shared position bias), by its key.
    step_cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True)
class LoraSegment:
    """Rows `start:end` use the adapter in device slot `slot`."""

    slot: int
    start: int
    end: int


@dataclass
class LoraGroups:
    """Rows `start:end` (each using an adapter) laid out for the stacked LoRA form: one group per
    adapter of the stack, `rows_per_group` rows each. `gather` [groups * rows_per_group] names the row
    that fills each group position (positions no row of the group fills take row `start` and are never
    read back); `scatter` [end - start] names, for each row, its position in its own group."""

    start: int
    end: int
    num_groups: int
    rows_per_group: int
    gather: torch.Tensor
    scatter: torch.Tensor


@dataclass
class LoraTiles:
    """The tile form of per-row LoRA (lora/kernels/tiles.py): `table` [3, count] int32 on the device, each tile's
    first row, number of rows and slot."""

    table: torch.Tensor
    count: int


@dataclass
class LoraRowSlots:
    """The per-row LoRA form (lora/kernels/rows.py): each row's slot, -1 for none (`slots` [T] int32), the
    engine's slot tables (a `SlotPointers`) and the layers some slot's adapter targets (the others add nothing).
    With `tiles` (eager steps, where prompts' rows share their adapter) the kernels take the tiles instead of
    `slots`, which is then None."""

    slots: torch.Tensor | None
    tables: Any
    layers: frozenset[str]
    max_rank: int
    tiles: LoraTiles | None = None


@dataclass
class LoraRows:
    """Which rows use which adapter, per kind of row a LoRA-wrapped linear sees.

    Rows are ordered by adapter (the runner sorts sequences so), so each adapter owns one contiguous
    segment; rows of the base model are in no segment. `tokens` covers the step's token rows; `logits`
    covers the rows handed to `compute_logits` and is set by the runner before each such call.
    """

    tokens: list[LoraSegment]
    logits: list[LoraSegment]
    weights: Mapping[str, Sequence[Any]]  # LoRA layer name -> the weights in each slot (None: no delta)
    # Image tiles seen by a vision tower and its projector, in units of tiles (the first dimension of
    # their [tiles, seq, features] inputs); set by the runner before it encodes a step's images.
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
    # On CUDA, for steps of short segments (decode) and CUDA graphs: per row kind, each row's slot (the per-row
    # form, which takes precedence over the stack and the segments).
    row_slots: dict[str, LoraRowSlots] = field(default_factory=dict)
    # The dtype the adapter weights hold (the model's compute dtype); an input in another dtype (a layer
    # kept in float32) has its delta computed in this one. None: the input's dtype.
    dtype: torch.dtype | None = None

    def segments(self, kind: str) -> list[LoraSegment]:
        if kind == "states":
            return self.encoder
        return {"tokens": self.tokens, "logits": self.logits, "patches": self.patches, "encoder": self.encoder}[kind]


def lora_segments(slots: list[int | None], row_counts: list[int]) -> list[LoraSegment]:
    """Segments of consecutive rows sharing an adapter slot (base-model rows belong to none)."""
    segments: list[LoraSegment] = []
    start = 0
    for slot, count in zip(slots, row_counts):
        if slot is not None and count > 0:
            last = segments[-1] if segments else None
            if last is not None and last.slot == slot and last.end == start:
                segments[-1] = LoraSegment(slot, last.start, start + count)
            else:
                segments.append(LoraSegment(slot, start, start + count))
        start += count
    return segments


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[Any]  # per attention layer, in the backend's own layout
    backend: Any  # an AttentionBackend
    lora: LoraRows | None = None  # None: no adapter in this step
    # The eager pass before a CUDA graph capture: layers take the kernels the capture will (compiling them first).
    graph_warm_up: bool = False


def in_graph_warm_up() -> bool:
    """Whether the running forward pass is the eager one that precedes a CUDA graph capture."""
    return _current is not None and _current.graph_warm_up


def current_lora_rows() -> LoraRows | None:
    """The step's adapter rows, or None outside a forward pass or when no row uses an adapter."""
    return _current.lora if _current is not None else None


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside a forward_context() block"
    return _current
