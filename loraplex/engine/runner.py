"""Turns one scheduled step into flat tensors, runs the model once, and samples.

Nothing here persists between steps except the KV cache tensors: batch tensors are rebuilt from
per-request state every step, so a request that finishes simply stops being scheduled.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from loraplex.engine.decode_graphs import DecodeGraphs
from loraplex.engine.grammar_masks import GrammarMasks, PendingMasks
from loraplex.engine.graph_inputs import HostPicks
from loraplex.engine.images import ImageFeatures, VisionCounters, step_input_embeds
from loraplex.engine.overlap import LaunchedStep
from loraplex.engine.scheduler import ScheduledRequest
from loraplex.engine.verification import SampledToken, apply_grammar_masks, sample_verified
from loraplex.environment import fused_projections_enabled
from loraplex.layers.attention import AttentionBackend, TritonAttentionBackend, default_backend
from loraplex.layers.forward_context import (
    AttentionMetadata,
    DecodeGroup,
    EncoderMetadata,
    ForwardContext,
    forward_context,
)
from loraplex.kernels import triton_available
from loraplex.layers.projections import fuse_projections
from loraplex.lora.plan import STACKED_ROWS_PER_SEGMENT, LoraPlan, LoraPlanner
from loraplex.lora.table import AdapterTable
from loraplex.sampling import Sampler, takes_plain_argmax, token_logprobs

NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class StepResult:
    """What one scheduled request got from the step."""

    # The tokens it got, in order: none while its prompt is still being prefilled in chunks, else one; with
    # drafts, the accepted ones and then the token the row after them drew (verification.py).
    tokens: list[SampledToken] = field(default_factory=list)
    # Log-probabilities of the prompt tokens this step covered (first prompt token: None).
    prompt_logprobs: list[float | None] = field(default_factory=list)
    error: str | None = None  # set when this request's computation failed; the request fails alone
    # Set when it could not run this step because a request whose KV blocks it reads failed (containment.py):
    # it goes back to the queue and recomputes them.
    requeue: bool = False


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # Encoder-decoder models: the inputs of the encoders that run this step (None: none runs).
    encoder_ids: torch.Tensor | None = None
    encoder_positions: torch.Tensor | None = None
    # The step's sequences whose states are made this step (their encoder or image encoder runs).
    encoding: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class GraphSettings:
    """Decode steps of up to `max_batch` sequences, each at most `max_seq_len` tokens long, run as CUDA graphs."""

    max_batch: int
    max_seq_len: int


@dataclass(frozen=True)
class ForcedTokens:
    """Tokens an encoder-decoder checkpoint's generation config forces (transformers' ForcedBOS/EOS
    logits processors): `bos` as the first generated token, one of `eos` (a config may list several; the
    lowest id wins the tie, as transformers' argmax) as the last one max_new_tokens allows."""

    bos: int | None = None
    eos: tuple[int, ...] = ()

    def for_request(self, request, drafts_before: int = 0) -> tuple[int, ...]:
        """The tokens this request's next step (or, for a verification row, the step `drafts_before` drafts
        later) is restricted to (empty: no restriction)."""
        generated = len(request.output_ids) + drafts_before
        if self.bos is not None and generated == 0:
            return (self.bos,)
        if self.eos and generated == request.params.max_new_tokens - 1:
            return self.eos
        return ()


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


def _row_order(scheduled: list[ScheduledRequest]) -> list[int]:
    """The step's rows: sequences of one adapter side by side, so that each adapter's rows form one segment (see
    LoraPlan). Row i is scheduled[order[i]]."""
    return sorted(range(len(scheduled)), key=lambda i: -1 if scheduled[i].request.adapter_slot is None
                  else scheduled[i].request.adapter_slot)


def _by_position(by_row: list[StepResult], order: list[int]) -> list[StepResult]:
    by_position = [StepResult()] * len(order)
    for result, i in zip(by_row, order):
        by_position[i] = result
    return by_position


def _all_decoding(scheduled: list[ScheduledRequest]) -> bool:
    """Every request computes one token and samples the next (no prefill, no drafts)."""
    return all(item.num_new_tokens == 1 and item.completes_sequence and not item.num_drafts for item in scheduled)


def _token_of(result: StepResult) -> int:
    """The token a launched row picked (any token when the row failed: its request ends when it is read)."""
    return result.tokens[0].token_id if result.tokens else 0


def fused_projections_wanted(device: torch.device) -> bool:
    """Sibling projections (q/k/v, gate/up) in one product on CUDA (layers/projections.py), unless
    LORAPLEX_FUSE_PROJECTIONS=0. The CPU keeps one product each: its results stay bit for bit those of the parity
    tests."""
    return device.type == "cuda" and fused_projections_enabled()


class ModelRunner:
    def __init__(
        self, model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
        block_size: int, device: torch.device, dtype: torch.dtype, backend: AttentionBackend | None = None,
        lora: AdapterTable | None = None, forced_tokens: ForcedTokens | None = None, num_state_blocks: int = 0,
        graphs: GraphSettings | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # the engine's device slots (None: no adapters)
        self.device, self.dtype = device, dtype
        if fused_projections_wanted(device):  # before any graph captures the unfused products
            fuse_projections(model)
        self.block_size = block_size
        self.backend = backend or default_backend(device)
        # Layers that cache only cross-attention states (Mllama's cross layers) get `num_state_blocks` blocks
        # of their own pool; the others `num_blocks` of the token pool (0: one pool for every layer).
        state_layers = set(getattr(model, "state_layers", ())) if num_state_blocks else set()
        self.token_layers = [i for i in range(num_layers) if i not in state_layers]
        self.state_layers = sorted(state_layers)
        # Decode steps in CUDA graphs (decode_graphs.py) where the model and the device allow them. Their
        # padding rows write into one more block than the scheduler hands out.
        graphed = (graphs is not None and triton_available(device) and isinstance(self.backend, TritonAttentionBackend)
                   and not hasattr(model, "encode") and not hasattr(model, "image_states"))
        caches = dict(zip(self.token_layers, self.backend.allocate_kv_cache(
            len(self.token_layers), num_blocks + graphed, block_size, num_kv_heads, head_dim, dtype, device
        )))
        if self.state_layers:
            caches.update(zip(self.state_layers, self.backend.allocate_kv_cache(
                len(self.state_layers), num_state_blocks, block_size, num_kv_heads, head_dim, dtype, device
            )))
        self.kv_caches = [caches[i] for i in range(num_layers)]
        self.sampler = Sampler()
        # Per-request image features while prompts are prefilled (models that put images in the token stream).
        self.image_features = ImageFeatures() if hasattr(model, "encode_images") else None
        self.stacked_rows_per_segment = STACKED_ROWS_PER_SEGMENT.get(device.type, 8)
        # Models whose cross-attention reads per-request states, made at a request's first step (after each
        # admission): an encoder-decoder's encoder output, or a vision model's image states (Mllama).
        self.encoder_decoder = hasattr(model, "encode")
        self.image_states = hasattr(model, "image_states")
        self.vision_counters = (
            self.image_features.counters if self.image_features is not None
            else VisionCounters() if self.image_states else None
        )
        self.forced_tokens = forced_tokens or ForcedTokens()
        self.grammar_masks: GrammarMasks | None = None  # set by the engine once a request has a grammar
        self.decode_graphs = (
            DecodeGraphs(model, self.backend, self.kv_caches, lora, graphs.max_batch, graphs.max_seq_len, block_size,
                         scratch_block=num_blocks, device=device)
            if graphed else None
        )
        self._host_picks = HostPicks(self.decode_graphs.max_batch) if graphed else None
        self.lora_planner = LoraPlanner(lora, device)  # each step's LoRA plan (lora/plan.py)

    @property
    def takes_images(self) -> bool:
        return self.vision_counters is not None

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], fresh_blocks: Sequence[int] = (), fresh_state_blocks: Sequence[int] = ()
    ) -> list[StepResult]:
        """Run one step; one result per scheduled request, in the order given.

        `fresh_blocks` (`fresh_state_blocks`: of the states' own pool) are KV blocks given to a new owner since
        the last step: they are zeroed first, so nothing a finished request left there (NaN included) can
        reach the new owner's attention.
        """
        self._clear(fresh_blocks, fresh_state_blocks)
        order = _row_order(scheduled)
        return _by_position(self._execute([scheduled[i] for i in order]), order)

    def _clear(self, fresh_blocks: Sequence[int], fresh_state_blocks: Sequence[int]) -> None:
        if self.state_layers:
            self.backend.clear_blocks([self.kv_caches[i] for i in self.token_layers], fresh_blocks)
            self.backend.clear_blocks([self.kv_caches[i] for i in self.state_layers], fresh_state_blocks)
        else:
            self.backend.clear_blocks(self.kv_caches, fresh_blocks)

    # ---- overlapped steps (engine/overlap.py) ---------------------------------------------------------------

    def launchable(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether the step can be launched before the host knows its input tokens: every request decodes one
        token, its plain argmax (then the step's picks on the device are its tokens), as a CUDA graph where
        graphs run."""
        decoding = self._graphable(scheduled) if self.decode_graphs is not None else _all_decoding(scheduled)
        return decoding and self._plain_argmax([item.request for item in scheduled])

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], fresh_blocks: Sequence[int] = (),
               fresh_state_blocks: Sequence[int] = (), after: LaunchedStep | None = None) -> LaunchedStep:
        """Start a `launchable` step without waiting for its tokens (`land` reads them). A request whose last token
        is a placeholder takes it from `after`, the step launched just before (its row's pick)."""
        self._clear(fresh_blocks, fresh_state_blocks)
        order = _row_order(scheduled)
        ordered = [scheduled[i] for i in order]
        requests = [item.request for item in ordered]
        from_after = [after.rows.get(r, -1) if after and r.num_pending else -1 for r in requests]
        assert all(r.num_pending == 0 or row >= 0 for r, row in zip(requests, from_after)), (
            "a placeholder token of a step that is not the one launched just before")
        launched = LaunchedStep({r: row for row, r in enumerate(requests)}, order)
        if self.decode_graphs is None:  # eager (CPU): the tokens are known at once
            tokens = {row: _token_of(after.results[source]) for row, source in enumerate(from_after) if source >= 0}
            launched.results = self._execute(ordered, tokens)
            return launched
        positions = [r.num_computed_tokens for r in requests]
        _, picks = self.decode_graphs.run(
            [0 if source >= 0 else r.token_slice(p, p + 1)[0] for r, p, source in zip(requests, positions, from_after)],
            positions, [r.block_ids for r in requests], [r.adapter_slot for r in requests], from_after,
        )
        launched.picks, launched.ready = self._host_picks.copy(picks)
        return launched

    def land(self, launched: LaunchedStep) -> list[StepResult]:
        """The results of a launched step, in the order it was scheduled (waits for the device)."""
        results = launched.results
        if results is None:
            launched.ready.synchronize()
            tokens, logprobs, finite = launched.picks.tolist()
            results = [StepResult([SampledToken(int(t), lp)]) if ok else StepResult(error=NON_FINITE)
                       for t, lp, ok in zip(tokens, logprobs, finite)]
        return _by_position(results, launched.order)

    # ---- one step ------------------------------------------------------------------------------------------

    def _execute(self, scheduled: list[ScheduledRequest], input_tokens: dict[int, int] | None = None) -> list[StepResult]:
        """`input_tokens`: the input token of decoding sequences whose last token is a placeholder (overlap.py)."""
        if self._graphable(scheduled):
            return self._execute_graphed(scheduled)
        batch = self._build_batch(scheduled, input_tokens)
        slots = [item.request.adapter_slot for item in scheduled]
        starts = batch.metadata.query_start_loc
        lora = self.lora_planner.plan(
            slots, [starts[i + 1] - starts[i] for i in range(len(slots))], self.stacked_rows_per_segment,
            [slots[i] for i in batch.encoding], [scheduled[i].request.num_states for i in batch.encoding],
        )
        ctx = ForwardContext(batch.metadata, self.kv_caches, self.backend, lora)
        results = [StepResult() for _ in scheduled]
        sample_seqs = [i for i, s in enumerate(scheduled) if s.completes_sequence]
        # Structured output: the sampled rows' masks are filled on llguidance's threads while the model runs.
        masks = self.grammar_masks.start([scheduled[i].request.grammar for i in sample_seqs]) if self.grammar_masks else None
        with forward_context(ctx):
            hidden = self._forward(scheduled, batch, lora)
            if sample_seqs:
                self._sample(scheduled, sample_seqs, hidden, starts, lora, results, masks)
            for i, item in enumerate(scheduled):
                request = item.request
                if request.params.prompt_logprobs and len(request.prompt_logprobs or []) < len(request.prompt_ids):
                    results[i].prompt_logprobs = self._prompt_logprobs(item, hidden[starts[i] : starts[i + 1]], lora)
        return results

    def _graphable(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether this step runs as a CUDA graph: every request decodes one token (no prefill, no drafts)."""
        graphs = self.decode_graphs
        return graphs is not None and len(scheduled) <= graphs.max_batch and _all_decoding(scheduled)

    def _execute_graphed(self, scheduled: list[ScheduledRequest]) -> list[StepResult]:
        requests = [item.request for item in scheduled]
        masks = self.grammar_masks.start([r.grammar for r in requests]) if self.grammar_masks else None
        positions = [r.num_computed_tokens for r in requests]
        logits, picks = self.decode_graphs.run(
            [r.token_slice(p, p + 1)[0] for r, p in zip(requests, positions)], positions,
            [r.block_ids for r in requests], [r.adapter_slot for r in requests],
        )
        results = [StepResult() for _ in scheduled]
        if masks is None and self._plain_argmax(requests):  # the graph's own picks are the answer: one read
            tokens, logprobs, finite = picks.tolist()
            if all(finite):
                for result, token, logprob in zip(results, tokens, logprobs):
                    result.tokens = [SampledToken(int(token), logprob)]
                return results
        self._sample_logits(scheduled, list(range(len(scheduled))), [1] * len(scheduled), logits, results, masks,
                            picks[2] != 0)
        return results

    def _plain_argmax(self, requests: list) -> bool:
        """Whether every request's next token is the argmax of its raw logits (nothing forced, masked,
        penalised or warped, no alternatives reported)."""
        forced = self.forced_tokens
        return (forced.bos is None and not forced.eos
                and all(r.grammar is None and takes_plain_argmax(r.params) for r in requests))

    def _sample(
        self, scheduled: list[ScheduledRequest], seqs: list[int], hidden: torch.Tensor, starts: list[int],
        lora: LoraPlan | None, results: list[StepResult], masks: PendingMasks | None = None,
    ) -> None:
        """The next token of each sequence of `seqs`, from its last row; a sequence with k drafts has its last
        k + 1 rows sampled and keeps the tokens verification accepts (verification.py)."""
        counts = [scheduled[i].num_drafts + 1 for i in seqs]
        rows = [row for i, c in zip(seqs, counts) for row in range(starts[i + 1] - c, starts[i + 1])]
        if lora is not None:
            lora.set_rows("logits", [scheduled[i].request.adapter_slot for i in seqs], counts)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        self._sample_logits(scheduled, seqs, counts, logits, results, masks)

    def _sample_logits(
        self, scheduled: list[ScheduledRequest], seqs: list[int], counts: list[int], logits: torch.Tensor,
        results: list[StepResult], masks: PendingMasks | None, finite: torch.Tensor | None = None,
    ) -> None:
        """Sample `seqs` from their logits rows (`counts[i]` rows for sequence seqs[i], in order); `finite`: whether
        each row's logits are all finite, where already computed."""
        started = seqs
        logits, seqs = self._drop_non_finite(logits, seqs, counts, results, finite)
        try:
            self._process_and_sample(scheduled, started, seqs, logits, results, masks)
        except Exception:  # noqa: BLE001 — one request's logits processing or sampling: it fails alone
            if len(seqs) < 2:
                raise
            self._sample_one_by_one(scheduled, seqs, logits, results)

    def _sample_one_by_one(
        self, scheduled: list[ScheduledRequest], seqs: list[int], logits: torch.Tensor, results: list[StepResult]
    ) -> None:
        """Sample each sequence on its own rows (its grammar mask computed here), failing those that raise. The
        rows may be partly processed already: forced tokens and masks are idempotent, the sampler draws from a
        row's own logits and key (sampling.py), so each sequence gets the token of a batch without the fault."""
        first = 0
        for i in seqs:
            rows = logits[first : first + scheduled[i].num_drafts + 1]
            first += rows.shape[0]
            try:
                self._process_and_sample(scheduled, [i], [i], rows, results, None)
            except Exception as error:  # noqa: BLE001
                results[i].tokens, results[i].error = [], f"sampling failed for this request: {error}"

    def _process_and_sample(
        self, scheduled: list[ScheduledRequest], started: list[int], seqs: list[int], logits: torch.Tensor,
        results: list[StepResult], masks: PendingMasks | None,
    ) -> None:
        """Forced tokens, grammar masks (`masks`: started for the sequences `started`), then sampling."""
        requests = [scheduled[i].request for i in seqs]
        drafts = [r.draft_ids[: scheduled[i].num_drafts] for r, i in zip(requests, seqs)]
        self._force_tokens(logits, requests, drafts)
        if masks is not None:  # each sequence's first row: the masks started before the forward pass
            first_rows = dict(zip(seqs, itertools.accumulate((len(d) + 1 for d in drafts), initial=0)))
            masks.apply(logits, [first_rows.get(i) for i in started])
        apply_grammar_masks(logits, [r.grammar for r in requests], drafts, first_rows_masked=masks is not None)
        kept = sample_verified(
            self.sampler, logits, [r.params for r in requests], [r.prompt_ids for r in requests],
            [r.output_ids for r in requests], [r.seed for r in requests], drafts,
        )
        for i, tokens in zip(seqs, kept):
            results[i].tokens = tokens

    def _forward(self, scheduled: list[ScheduledRequest], batch: "_Batch", lora: LoraPlan | None) -> torch.Tensor:
        if self.encoder_decoder:
            encoded = None
            if batch.encoder_ids is not None:  # several requests' encoders in one call, rows concatenated
                encoded = self.model.encode(batch.encoder_ids, batch.encoder_positions)
            return self.model(batch.input_ids, batch.positions, encoder_hidden=encoded)
        if self.image_states:
            made = self._image_states([scheduled[i].request for i in batch.encoding], lora) if batch.encoding else None
            return self.model(batch.input_ids, batch.positions, cross_states=made)
        if self.image_features is None:
            return self.model(batch.input_ids, batch.positions)
        embeds = step_input_embeds(
            self.model, scheduled, batch.input_ids, batch.metadata.query_start_loc, self.image_features, lora
        )
        hidden = self.model(batch.input_ids, batch.positions, inputs_embeds=embeds)
        for item in scheduled:  # a prompt fully computed needs its image features no more
            request = item.request
            if request.images is not None and request.num_computed_tokens + item.num_new_tokens >= len(request.prompt_ids):
                self.image_features.drop(request.request_id)
        return hidden

    def _image_states(self, requests: list, lora: LoraPlan | None) -> torch.Tensor:
        """The image states of `requests` [their num_states, hidden], each request's in its layout's order.

        All their images go through the image encoder as one batch, each request's contiguous (in slot
        order: one LoRA segment per adapter, counted in images)."""
        if lora is not None:
            lora.set_rows("patches", [r.adapter_slot for r in requests], [r.images.num_images for r in requests])
        weight = next(self.model.parameters())
        started = time.perf_counter()
        states = self.model.image_states(
            torch.cat([r.images.pixel_values for r in requests]).to(weight.device, weight.dtype),
            torch.cat([r.images.aspect_ratio_ids for r in requests]).to(weight.device),
            torch.cat([r.images.aspect_ratio_mask for r in requests]).to(weight.device),
        )  # [images, tiles, states_per_tile, hidden]
        self.vision_counters.record(states.shape[0], time.perf_counter() - started)
        per_request, first = [], 0
        for r in requests:
            mine = states[first : first + r.images.num_images].flatten(0, 1)  # [tiles, states_per_tile, hidden]
            first += r.images.num_images
            order = torch.tensor(r.images.layout.tile_order, device=mine.device)
            per_request.append(mine.index_select(0, order).flatten(0, 1))
        return torch.cat(per_request)

    def forget(self, request_id: str) -> None:
        """Drop what the runner holds for a request that left the engine."""
        if self.image_features is not None:
            self.image_features.drop(request_id)

    def _force_tokens(self, logits: torch.Tensor, requests: list, drafts: list[list[int]]) -> None:
        """Rows whose next token the checkpoint forces: every other token's logit becomes -inf. Request i has
        len(drafts[i]) + 1 rows, row j as many generated tokens ahead."""
        rows = ((request, j) for request, d in zip(requests, drafts) for j in range(len(d) + 1))
        for row, (request, j) in enumerate(rows):
            tokens = self.forced_tokens.for_request(request, j)
            if tokens:
                logits[row] = float("-inf")
                logits[row, list(tokens)] = 0.0

    @staticmethod
    def _drop_non_finite(
        logits: torch.Tensor, seqs: list[int], counts: list[int], results: list[StepResult],
        finite: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Fail the sequences (`counts[i]` rows each) with a row of NaN or inf logits (a diverging adapter; a
        draft's row too: its keys and values would poison the cache); sample the rest. `finite` [rows]: whether
        each row is all finite, checked already (a CUDA graph does it)."""
        # A row's sum is finite when every logit is (NaN and inf propagate): one cheap reduction per step,
        # the full check only when it fails.
        if finite is None:
            finite = torch.isfinite(logits.sum(dim=1, dtype=torch.float32))
        if finite.all():
            return logits, seqs
        finite = torch.isfinite(logits).all(dim=1).tolist()
        if all(finite):
            return logits, seqs
        owner = [i for i, c in zip(seqs, counts) for _ in range(c)]
        failed = {i for ok, i in zip(finite, owner) if not ok}
        for i in failed:
            results[i].error = NON_FINITE
        keep = [row for row, i in enumerate(owner) if i not in failed]
        return logits[keep], [i for i in seqs if i not in failed]

    def _prompt_logprobs(
        self, item: ScheduledRequest, hidden: torch.Tensor, lora: LoraPlan | None
    ) -> list[float | None]:
        """Log-probabilities of the prompt tokens this step can score, given the tokens before each.

        Prompt token i is scored by the row of position i - 1, so a chunk [start, end) scores tokens
        start + 1 .. end; token 0 has none. Tokens already scored (before a preemption) are skipped.
        """
        request = item.request
        start = request.num_computed_tokens
        have = len(request.prompt_logprobs or [])
        values: list[float | None] = [None] if have == 0 else []
        first = max(have, start + 1)
        last = min(start + item.num_new_tokens, len(request.prompt_ids) - 1)  # inclusive
        if last >= first:
            rows = hidden[first - 1 - start : last - start]
            if lora is not None:
                lora.set_rows("logits", [request.adapter_slot], [rows.shape[0]])
            logits = self.model.compute_logits(rows)
            # A token the head cannot produce (Mllama's image token, past its vocabulary) has no logprob.
            ids = request.prompt_ids[first : last + 1]
            producible = [0 <= t < logits.shape[1] for t in ids]
            targets = torch.tensor([t if ok else 0 for t, ok in zip(ids, producible)], device=self.device)
            scored = token_logprobs(logits, targets).tolist()
            values += [v if ok else None for v, ok in zip(scored, producible)]
        return values

    def _build_batch(self, scheduled: list[ScheduledRequest], input_tokens: dict[int, int] | None = None) -> _Batch:
        """`input_tokens`: sequence -> the input token of a decoding sequence whose last token is a placeholder."""
        input_tokens = input_tokens or {}
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        decode_seqs: list[int] = []
        prefill_seqs: list[int] = []
        for s, item in enumerate(scheduled):
            request = item.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens
            blocks = request.block_ids
            # Past its known tokens: the drafts it verifies (engine/verification.py).
            known = [input_tokens[s]] if s in input_tokens else request.token_slice(start, min(end, request.num_tokens))
            input_ids += known + request.draft_ids[: item.num_drafts]
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            (decode_seqs if item.num_new_tokens == 1 else prefill_seqs).append(s)

        max_blocks = max(len(item.request.block_ids) for item in scheduled)
        # Padded with each sequence's own last block: a padded key position then never reads another
        # request's block (only this sequence's own, or zeros; see `execute`).
        tables = [ids + ids[-1:] * (max_blocks - len(ids)) for ids in (item.request.block_ids for item in scheduled)]
        dev = self.device

        def long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

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
        )
        batch = _Batch(long(input_ids), long(positions), metadata)
        if self.encoder_decoder or self.image_states:
            self._add_states(scheduled, batch)
        return batch

    def _decode_groups(self, decode_seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
        """Decode sequences grouped by length where the backend pads each group to its longest; else one group."""
        if self.backend.pads_decode_groups:
            return group_by_length(decode_seqs, seq_lens)
        return [decode_seqs] if decode_seqs else []

    def _add_states(self, scheduled: list[ScheduledRequest], batch: _Batch) -> None:
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

        def long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

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
