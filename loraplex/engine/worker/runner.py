"""Runs one scheduled step: builds its batch (batch.py), calls the model once (model_call.py, or a CUDA graph:
decode_graphs.py), and turns the logits into tokens (logits.py).

Nothing here persists between steps except the KV cache tensors: batch tensors are rebuilt from
per-request state every step, so a request that finishes simply stops being scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from loraplex.engine.worker.batch import BatchBuilder, all_decoding, by_position, row_order
from loraplex.engine.worker.decode_graphs import CaptureFailed, DecodeGraphs, graphable_family
from loraplex.engine.sampling.grammar_masks import GrammarMasks, PendingMasks
from loraplex.engine.worker.graph_inputs import HostPicks
from loraplex.engine.sampling.logits import ForcedTokens, LogitsPipeline, StepResult, picked_results, plain_argmax
from loraplex.engine.worker.model_call import ModelCall, prompt_logprobs, wants_prompt_logprobs
from loraplex.engine.worker.overlap import LaunchedStep
from loraplex.engine.worker.pooling import Pooler
from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.environment import fused_projections_enabled
from loraplex.kernels import triton_available
from loraplex.layers.attention import AttentionBackend, TritonAttentionBackend, default_backend
from loraplex.layers.forward_context import ForwardContext, forward_context
from loraplex.layers.kv_quant import set_kv_scales
from loraplex.layers.projections import fuse_projections
from loraplex.lora.step.plan import LoraPlan, LoraPlanner
from loraplex.lora.device.table import AdapterTable
from loraplex.models.base import ModelFamily


@dataclass(frozen=True)
class GraphSettings:
    """Decode steps of up to `max_batch` sequences, each at most `max_seq_len` tokens long, run as CUDA graphs."""

    max_batch: int
    max_seq_len: int


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
        self, model: ModelFamily, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
        block_size: int, device: torch.device, dtype: torch.dtype, backend: AttentionBackend | None = None,
        lora: AdapterTable | None = None, forced_tokens: ForcedTokens | None = None, num_state_blocks: int = 0,
        graphs: GraphSettings | None = None, kv_cache_dtype: torch.dtype | None = None,
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
        state_layers = set(model.state_layers) if num_state_blocks else set()
        self.token_layers = [i for i in range(num_layers) if i not in state_layers]
        self.state_layers = sorted(state_layers)
        # Decode steps in CUDA graphs (decode_graphs.py) where the model and the device allow them. Their
        # padding rows write into one more block than the scheduler hands out.
        graphed = (graphs is not None and triton_available(device) and isinstance(self.backend, TritonAttentionBackend)
                   and graphable_family(model.inputs))
        kv_dtype = kv_cache_dtype or dtype  # an FP8 cache: layers/kv_quant.py
        caches = dict(zip(self.token_layers, self.backend.allocate_kv_cache(
            len(self.token_layers), num_blocks + graphed, block_size, num_kv_heads, head_dim, kv_dtype, device
        )))
        if self.state_layers:
            caches.update(zip(self.state_layers, self.backend.allocate_kv_cache(
                len(self.state_layers), num_state_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device
            )))
        self.kv_caches = [caches[i] for i in range(num_layers)]
        self.batches = BatchBuilder(block_size, device, self.backend, model.inputs)
        self.model_call = ModelCall(model)
        self.pooler = Pooler()  # embedding requests' partial sums, across their prompts' chunks
        self.image_features = self.model_call.image_features  # per-request image features (LLaVA-NeXT)
        self.vision_counters = self.model_call.vision_counters
        self.logits = LogitsPipeline(forced_tokens)
        self.grammar_masks: GrammarMasks | None = None  # set by the engine once a request has a grammar
        self.lora_planner = LoraPlanner(lora, device)  # each step's LoRA plan, eager or graphed (lora/step/plan.py)
        self.decode_graphs = (
            DecodeGraphs(model, self.backend, self.kv_caches, self.lora_planner, graphs.max_batch, graphs.max_seq_len,
                         block_size, scratch_block=num_blocks, device=device)
            if graphed else None
        )
        self._host_picks = HostPicks(self.decode_graphs.max_batch) if graphed else None

    @property
    def takes_images(self) -> bool:
        return self.vision_counters is not None

    def set_kv_scales(self, scales) -> None:
        """{layer index: (k_scale, v_scale)} into an FP8 cache's scale tensors, in place (graphs read them)."""
        set_kv_scales(self.kv_caches, scales)

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
        order = row_order(scheduled)
        return by_position(self._execute([scheduled[i] for i in order]), order)

    def _clear(self, fresh_blocks: Sequence[int], fresh_state_blocks: Sequence[int]) -> None:
        if self.state_layers:
            self.backend.clear_blocks([self.kv_caches[i] for i in self.token_layers], fresh_blocks)
            self.backend.clear_blocks([self.kv_caches[i] for i in self.state_layers], fresh_state_blocks)
        else:
            self.backend.clear_blocks(self.kv_caches, fresh_blocks)

    def forget(self, request_id: str) -> None:
        """Drop what the runner holds for a request that left the engine."""
        self.model_call.forget(request_id)
        self.pooler.forget(request_id)

    # ---- overlapped steps (engine/worker/overlap.py) ---------------------------------------------------------------

    def launchable(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether the step can be launched before the host knows its input tokens: every request decodes one
        token, its plain argmax (then the step's picks on the device are its tokens), as a CUDA graph where
        graphs run."""
        decoding = self._graphable(scheduled) if self.decode_graphs is not None else all_decoding(scheduled)
        return decoding and plain_argmax([item.request for item in scheduled], self.logits.forced_tokens)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], fresh_blocks: Sequence[int] = (),
               fresh_state_blocks: Sequence[int] = (), after: LaunchedStep | None = None) -> LaunchedStep:
        """Start a `launchable` step without waiting for its tokens (`land` reads them). A request whose last token
        is a placeholder takes it from `after`, the step launched just before (its row's pick)."""
        self._clear(fresh_blocks, fresh_state_blocks)
        order = row_order(scheduled)
        ordered = [scheduled[i] for i in order]
        requests = [item.request for item in ordered]
        from_after = [after.rows.get(r, -1) if after and r.num_pending else -1 for r in requests]
        assert all(r.num_pending == 0 or row >= 0 for r, row in zip(requests, from_after)), (
            "a placeholder token of a step that is not the one launched just before")
        launched = LaunchedStep({r: row for row, r in enumerate(requests)}, order)
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_replay(len(requests), [r.adapter_slot for r in requests]):
            positions = [r.num_computed_tokens for r in requests]
            try:
                _, picks = graphs.run(
                    [0 if source >= 0 else r.token_slice(p, p + 1)[0]
                     for r, p, source in zip(requests, positions, from_after)],
                    positions, [r.block_ids for r in requests], [r.adapter_slot for r in requests], from_after,
                )
            except CaptureFailed:
                pass  # this step (and its bucket's next ones) runs eagerly, below
            else:
                launched.picks, launched.ready = self._host_picks.copy(picks)
                return launched
        # Eager (the CPU; a bucket whose capture just failed): the tokens are known at once.
        before = None
        if after is not None:  # its results by row: known at its launch if eager, else its picks once read
            if after.results is None:
                after.ready.synchronize()
            before = after.results if after.results is not None else picked_results(after.picks.tolist())
        tokens = {row: _token_of(before[source]) for row, source in enumerate(from_after) if source >= 0}
        launched.results = self._execute(ordered, tokens)
        return launched

    def land(self, launched: LaunchedStep) -> list[StepResult]:
        """The results of a launched step, in the order it was scheduled (waits for the device)."""
        results = launched.results
        if results is None:
            launched.ready.synchronize()
            results = picked_results(launched.picks.tolist())
        return by_position(results, launched.order)

    # ---- one step ------------------------------------------------------------------------------------------

    def _execute(self, scheduled: list[ScheduledRequest], input_tokens: dict[int, int] | None = None) -> list[StepResult]:
        """`input_tokens`: the input token of decoding sequences whose last token is a placeholder (overlap.py)."""
        if self._graphable(scheduled):
            results = self._execute_graphed(scheduled)
            if results is not None:
                return results
        batch = self.batches.build(scheduled, input_tokens)
        slots = [item.request.adapter_slot for item in scheduled]
        starts = batch.metadata.query_start_loc
        lora = self.lora_planner.plan(
            slots, [starts[i + 1] - starts[i] for i in range(len(slots))],
            [slots[i] for i in batch.encoding], [scheduled[i].request.num_states for i in batch.encoding],
        )
        ctx = ForwardContext(batch.metadata, self.kv_caches, self.backend, lora)
        results = [StepResult() for _ in scheduled]
        sample_seqs = [i for i, s in enumerate(scheduled) if s.completes_sequence and s.request.params.pooling is None]
        # Structured output: the sampled rows' masks are filled on llguidance's threads while the model runs.
        masks = self._start_masks([scheduled[i].request for i in sample_seqs])
        with forward_context(ctx):
            hidden = self.model_call.forward(scheduled, batch, lora)
            if sample_seqs:
                self._sample(scheduled, sample_seqs, hidden, starts, lora, results, masks)
            for i, item in enumerate(scheduled):
                if item.request.params.pooling is not None:
                    results[i].embedding = self.pooler.add(item, self._pooled_rows(i, batch, hidden, starts))
                if wants_prompt_logprobs(item.request):
                    def head(rows: torch.Tensor, slot: int | None = item.request.adapter_slot) -> torch.Tensor:
                        return self._logits(rows, lora, [slot], [rows.shape[0]])

                    results[i].prompt_logprobs = prompt_logprobs(item, hidden[starts[i] : starts[i + 1]], head)
        return results

    def _pooled_rows(self, i: int, batch, hidden: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """The rows embedding request `i` pools this step: its encoder's output on an encoder-decoder model (which
        encodes it whole in its first step, as sentence-T5 pools it), else its token rows."""
        encoded = self.model_call.encoded
        if encoded is None:
            return hidden[starts[i] : starts[i + 1]]
        k, where = batch.encoding.index(i), batch.metadata.encoder.query_start_loc
        return encoded[where[k] : where[k + 1]]

    def _graphable(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether this step runs as a CUDA graph: every request decodes one token (no prefill, no drafts)."""
        graphs = self.decode_graphs
        return (graphs is not None and all_decoding(scheduled)
                and graphs.can_replay(len(scheduled), [item.request.adapter_slot for item in scheduled]))

    def _execute_graphed(self, scheduled: list[ScheduledRequest]) -> list[StepResult] | None:
        """The step as a graph replay; None when its graph could not be captured (it then runs eagerly)."""
        requests = [item.request for item in scheduled]
        masks = self._start_masks(requests)
        positions = [r.num_computed_tokens for r in requests]
        try:
            logits, picks = self.decode_graphs.run(
                [r.token_slice(p, p + 1)[0] for r, p in zip(requests, positions)], positions,
                [r.block_ids for r in requests], [r.adapter_slot for r in requests],
            )
        except CaptureFailed:
            if masks is not None:
                masks.future.result()  # the eager step fills the same matchers' masks again
            return None
        return self.logits.sample_picked(scheduled, logits, picks, masks)

    def _start_masks(self, requests: list) -> PendingMasks | None:
        return self.grammar_masks.start([r.grammar for r in requests]) if self.grammar_masks else None

    def _sample(
        self, scheduled: list[ScheduledRequest], seqs: list[int], hidden: torch.Tensor, starts: list[int],
        lora: LoraPlan | None, results: list[StepResult], masks: PendingMasks | None = None,
    ) -> None:
        """The next token of each sequence of `seqs`, from its last row; a sequence with k drafts has its last
        k + 1 rows sampled and keeps the tokens verification accepts (verification.py)."""
        counts = [scheduled[i].num_drafts + 1 for i in seqs]
        rows = [row for i, c in zip(seqs, counts) for row in range(starts[i + 1] - c, starts[i + 1])]
        slots = [scheduled[i].request.adapter_slot for i in seqs]
        logits = self._logits(hidden[torch.tensor(rows, device=self.device)], lora, slots, counts)
        self.logits.sample(scheduled, seqs, counts, logits, results, masks)

    def _logits(
        self, hidden: torch.Tensor, lora: LoraPlan | None, slots: list[int | None], counts: list[int]
    ) -> torch.Tensor:
        """The head over `hidden` rows: counts[i] of them with adapter slots[i]."""
        if lora is not None:
            lora.set_rows("logits", slots, counts)
        return self.model.compute_logits(hidden)
