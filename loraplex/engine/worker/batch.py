"""A scheduled step as flat tensors: token ids, positions, cache slots, block tables, decode groups and, for
families whose cross-attention reads per-request states, where those states live and which rows see them.

Built afresh every step from per-request state; nothing here outlives the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.layers.attention import AttentionBackend
from loraplex.layers.forward_context import AttentionMetadata, DecodeGroup, EncoderMetadata
from loraplex.models.base import ModelInputs


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Encoder-decoder models: the inputs of the encoders that run this step (None: none runs).
    encoder_ids: torch.Tensor | None = None
    encoder_positions: torch.Tensor | None = None
    # The step's sequences whose states are made this step (their encoder or image encoder runs).
    encoding: list[int] = field(default_factory=list)


def group_by_length(
    seqs: list[int], seq_lens: list[int], max_spread: float = 1.5, min_gap: int = 64
) -> list[list[int]]:
    """Split decode sequences into groups whose longest is at most `max_spread` x their shortest (or at
    most `min_gap` tokens longer: short padding is cheaper than another call).

    Each group is attended over keys padded to its longest member, so mixed lengths waste little; a
    few groups cost a few more calls per layer.
    """
    groups: list[list[int]] = []
    for s in sorted(seqs, key=lambda i: seq_lens[i]):
        shortest = seq_lens[groups[-1][0]] if groups else 0
        if groups and (seq_lens[s] <= max_spread * shortest or seq_lens[s] - shortest <= min_gap):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def row_order(scheduled: list[ScheduledRequest]) -> list[int]:
    """The step's rows: sequences of one adapter side by side, so that each adapter's rows form one segment (see
    LoraPlan). Row i is scheduled[order[i]]."""
    return sorted(range(len(scheduled)), key=lambda i: -1 if scheduled[i].request.adapter_slot is None
                  else scheduled[i].request.adapter_slot)


def by_position(by_row: list, order: list[int]) -> list:
    """Results by row (`row_order`) back in the order the requests were scheduled."""
    by_position = [None] * len(order)
    for result, i in zip(by_row, order):
        by_position[i] = result
    return by_position


def all_decoding(scheduled: list[ScheduledRequest]) -> bool:
    """Every request computes one token and samples the next (no prefill, no drafts)."""
    return all(item.num_new_tokens == 1 and item.completes_sequence and not item.num_drafts for item in scheduled)


class BatchBuilder:
    """Builds a step's batch for one runner: its KV block size, device and attention backend (which says
    whether decode rows are grouped by length), and the model's inputs (which say whether states are laid out)."""

    def __init__(self, block_size: int, device: torch.device, backend: AttentionBackend, inputs: ModelInputs) -> None:
        self.block_size, self.device, self.backend = block_size, device, backend
        self.with_states = bool(inputs & (ModelInputs.ENCODER | ModelInputs.IMAGE_STATES))
        self.image_states = ModelInputs.IMAGE_STATES in inputs

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def build(self, scheduled: list[ScheduledRequest], input_tokens: dict[int, int] | None = None) -> StepBatch:
        """`input_tokens`: sequence -> the input token of a decoding sequence whose last token is a placeholder."""
        input_tokens = input_tokens or {}
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        rope_lens: list[int] = []
        decode_seqs: list[int] = []
        prefill_seqs: list[int] = []
        for s, item in enumerate(scheduled):
            request = item.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens
            blocks = request.block_ids
            # Past its known tokens: the drafts it verifies (engine/sampling/verification.py).
            known = [input_tokens[s]] if s in input_tokens else request.token_slice(start, min(end, request.num_tokens))
            input_ids += known + request.draft_ids[: item.num_drafts]
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            rope_lens.append(max(end, request.num_tokens))
            (decode_seqs if item.num_new_tokens == 1 else prefill_seqs).append(s)

        max_blocks = max(len(item.request.block_ids) for item in scheduled)
        # Padded with each sequence's own last block: a padded key position then never reads another
        # request's block (only this sequence's own, or zeros: the runner zeroes fresh blocks).
        tables = [ids + ids[-1:] * (max_blocks - len(ids)) for ids in (item.request.block_ids for item in scheduled)]
        long = self._long
        metadata = AttentionMetadata(
            slot_mapping=long(slots),
            block_tables=long(tables),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            decode_groups=[
                DecodeGroup(long(g), long([query_start_loc[s] for s in g]), long([seq_lens[s] for s in g]),
                            max(seq_lens[s] for s in g))
                for g in self._decode_groups(decode_seqs, seq_lens)
            ],
            prefill_seqs=prefill_seqs,
            rope_lens=rope_lens,
        )
        batch = StepBatch(long(input_ids), long(positions), metadata)
        if self.with_states:
            self._add_states(scheduled, batch)
        return batch

    def _decode_groups(self, decode_seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
        """Decode sequences grouped by length where the backend pads each group to its longest; else one group."""
        if self.backend.pads_decode_groups:
            return group_by_length(decode_seqs, seq_lens)
        return [decode_seqs] if decode_seqs else []

    def _add_states(self, scheduled: list[ScheduledRequest], batch: StepBatch) -> None:
        """Cross-attention states: the rows of the states made this step (an encoder's inputs, or the
        image states the forward pass makes), where every sequence's states live (its own blocks; table
        padded with its own last block) and, for image states, which of them each token row sees. No
        metadata when no sequence has states (text-only requests of a vision model)."""
        lens = [item.request.num_states for item in scheduled]
        if not any(lens):
            return
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        for s, item in enumerate(scheduled):
            request = item.request
            assert bool(request.num_states) == bool(request.cross_block_ids), "states without their blocks"
            if request.num_states and not request.states_ready:
                n = request.num_states
                batch.encoding.append(s)
                if request.encoder_ids is not None:
                    ids += request.encoder_ids
                    positions += range(n)
                slots += [request.cross_block_ids[p // bs] * bs + p % bs for p in range(n)]
                query_start_loc.append(query_start_loc[-1] + n)
        widest = max(len(item.request.cross_block_ids) for item in scheduled)
        # A sequence without states gets block 0's row: it is never read (its cross-attention output is zero).
        tables = [b + b[-1:] * (widest - len(b)) if b else [0] * widest
                  for b in (item.request.cross_block_ids for item in scheduled)]
        long = self._long
        md = batch.metadata
        prefilling = set(md.prefill_seqs)
        decode_seqs = [s for s in range(len(scheduled)) if s not in prefilling and lens[s]]
        groups = [
            DecodeGroup(long(g), long([md.query_start_loc[s] for s in g]), long([lens[s] for s in g]), max(lens[s] for s in g))
            for g in group_by_length(decode_seqs, lens)
        ]
        md.encoder = EncoderMetadata(query_start_loc, long(slots), long(tables), lens, groups)
        if self.image_states:
            self._add_visible_states(scheduled, md.encoder)
        if ids:
            batch.encoder_ids, batch.encoder_positions = long(ids), long(positions)

    def _add_visible_states(self, scheduled: list[ScheduledRequest], encoder: EncoderMetadata) -> None:
        """Per token row, the range of its request's image states it sees and whether it sees any."""
        first: list[int] = []
        end: list[int] = []
        seeing: list[bool] = []
        for item in scheduled:
            request, n = item.request, item.num_new_tokens
            layout = request.images.layout if request.images is not None else None
            if layout is None:  # text-only: sees nothing (its cross-attention output is zero)
                first += [0] * n
                end += [0] * n
                seeing += [False] * n
                continue
            rows = layout.rows(request.num_computed_tokens, request.num_computed_tokens + n)
            first += rows[0]
            end += rows[1]
            seeing += rows[2]
        encoder.row_first = torch.tensor(first, dtype=torch.long, device=self.device)
        encoder.row_end = torch.tensor(end, dtype=torch.long, device=self.device)
        if not all(seeing):
            encoder.rows_seeing = torch.tensor(seeing, dtype=torch.bool, device=self.device)
