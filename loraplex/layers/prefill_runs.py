"""The rows and keys of a step's prefill sequences, as the variable-length attention kernel takes them
(layers/kernels/varlen_prefill.py): prompts with nothing cached before them, and prompts resumed over cached context.
Each is computed once per step and kept in the step's metadata (every layer shares it)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from loraplex.layers.forward_context import AttentionMetadata


@dataclass(frozen=True)
class FreshPrompts:
    """The step's prompts with nothing cached before them: their rows (a slice when contiguous, else an index),
    their offsets within those rows (int32, on the device) and longest length; `others`: the other prefill
    sequences."""

    rows: slice | torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    others: list[int]


@dataclass(frozen=True)
class ResumedPrompts:
    """Prefill sequences over cached context: their new rows (as `FreshPrompts.rows`), every key's flat cache slot
    (sequence after sequence, each from its first position: context, then the new rows, which the layer wrote
    before attending), and the offsets (int32, on the device) and longest lengths of their queries and keys."""

    rows: slice | torch.Tensor
    key_slots: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_len_q: int
    max_len_k: int


def fresh_prompts(md: AttentionMetadata, device: torch.device) -> FreshPrompts | None:
    """Computed once per step (every layer shares it); None when no prompt is fresh."""
    if "fresh prompts" not in md.step_cache:
        starts, lens, fresh, others = md.query_start_loc, md.seq_lens, [], []
        for s in md.prefill_seqs:
            (fresh if lens[s] == starts[s + 1] - starts[s] else others).append(s)
        found = None
        if fresh:
            cu_seqlens = torch.tensor(offsets([lens[s] for s in fresh]), dtype=torch.int32, device=device)
            found = FreshPrompts(rows_of(md, fresh, device), cu_seqlens, max(lens[s] for s in fresh), others)
        md.step_cache["fresh prompts"] = found
    return md.step_cache["fresh prompts"]


def resumed_prompts(md: AttentionMetadata, seqs: list[int], block_size: int, device: torch.device) -> ResumedPrompts:
    """Computed once per step, for `seqs` (the same for every layer)."""
    if "resumed prompts" not in md.step_cache:
        starts, lens = md.query_start_loc, md.seq_lens
        new = [starts[s + 1] - starts[s] for s in seqs]
        total = [lens[s] for s in seqs]
        cu_q, cu_k = offsets(new), offsets(total)
        n = len(seqs)
        # Key j of the run is position j - cu_k[i] of sequence i, in block position // block_size of its table.
        # (Each list reaches the device in one copy.)
        seq_ids, per_key, first_key = torch.tensor([*seqs, *total, *cu_k[:-1]], device=device).split(n)
        keys = cu_k[-1]
        position = torch.arange(keys, device=device) - first_key.repeat_interleave(per_key, output_size=keys)
        seq_of_key = seq_ids.repeat_interleave(per_key, output_size=keys)
        key_slots = md.block_tables[seq_of_key, position // block_size] * block_size + position % block_size
        cu_seqlens_q, cu_seqlens_k = torch.tensor(cu_q + cu_k, dtype=torch.int32, device=device).split(n + 1)
        md.step_cache["resumed prompts"] = ResumedPrompts(
            rows_of(md, seqs, device), key_slots, cu_seqlens_q, cu_seqlens_k, max(new), max(total))
    return md.step_cache["resumed prompts"]


def offsets(lengths: list[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]"""
    return list(itertools.accumulate(lengths, initial=0))


def rows_of(md: AttentionMetadata, seqs: list[int], device: torch.device) -> slice | torch.Tensor:
    """The step's rows of `seqs` (in order): one slice when they are contiguous, else an index."""
    starts = md.query_start_loc
    if all(starts[b] == starts[a + 1] for a, b in zip(seqs, seqs[1:])):
        return slice(starts[seqs[0]], starts[seqs[-1] + 1])
    return torch.tensor([r for s in seqs for r in range(starts[s], starts[s + 1])], device=device)


def put_rows(out: torch.Tensor, rows: slice | torch.Tensor, attended: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = attended
    else:
        out.index_copy_(0, rows, attended)
