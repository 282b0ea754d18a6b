"""The per-step forward context: what the runner knows about the batch that some layers need.

The runner sets it with `with forward_context(ctx):` around one forward pass; attention and LoRA
layers read it. Model code never sees it, so model `forward` signatures stay those of a plain model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

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
    # Per sequence, the length its rotary scaling sees (dynamic NTK, LongRoPE): all its known tokens, so that every
    # chunk of a chunked prefill rotates as the whole prompt does in one forward. None: seq_lens.
    rope_lens: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def row_seq_lens(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] int64 on positions' device: each token row's sequence length for its rotary scaling (`rope_lens`, else
        its length after this step). A graphed decode step, whose lengths live on the device only, has one row per
        sequence: each row's position + 1, no tensor made on the host."""
        starts = self.query_start_loc
        if not self.rope_lens and len(starts) - 1 == positions.shape[0]:
            return positions + 1
        rows = torch.tensor([end - start for start, end in zip(starts, starts[1:])])
        return torch.tensor(self.rope_lens or self.seq_lens).repeat_interleave(rows).to(positions.device)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[Any]  # per attention layer, in the backend's own layout
    backend: Any  # an AttentionBackend
    # The step's LoRA plan (lora/step/plan.py), opaque here: only the LoRA layers read it. None: no adapter in this step.
    lora: object | None = None
    # The eager pass before a CUDA graph capture: layers take the kernels the capture will (compiling them first).
    graph_warm_up: bool = False


def in_graph_warm_up() -> bool:
    """Whether the running forward pass is the eager one that precedes a CUDA graph capture."""
    return _current is not None and _current.graph_warm_up


def current_lora() -> object | None:
    """The step's LoRA plan, or None outside a forward pass or when no row uses an adapter."""
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
