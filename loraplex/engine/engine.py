"""The engine: `step()` = schedule -> run -> update (decode steps overlapped with the host's work: overlap.py).

Synchronous and single-threaded; `AsyncEngine` drives it from a background thread for the server.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from loraplex.config import EngineConfig, ModelConfig
from loraplex.engine.containment import execute_contained, writers_of
from loraplex.engine.grammar_masks import GrammarMasks
from loraplex.engine.image_states import with_state_layout
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.engine.kv_cache import blocks_for
from loraplex.engine.loading import LoadedModel, load_model
from loraplex.engine.overlap import PENDING, InFlight, drop_placeholders, in_flight
from loraplex.engine.prefix_cache import root_key
from loraplex.engine.request import FinishReason, Request, RequestRefused, RequestStatus
from loraplex.engine.decode_graphs import BATCH_SIZES as GRAPH_BATCH_SIZES
from loraplex.engine.joins import WaitingJoins
from loraplex.engine.runner import ForcedTokens, GraphSettings, ModelRunner, StepResult
from loraplex.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from loraplex.engine.speculative import SpecDecodeCounters, drafts_for
from loraplex.engine.verification import SampledToken
from loraplex.engine.warm_up import WarmUpReport, warm_up
from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.layers import LoraSlots
from loraplex.params import GrammarSpec, SamplingParams, TokenInfo
from loraplex.structured import GrammarError, GrammarLimits, Grammars, GrammarTooCostly, advance
from loraplex.tokenizer import IncrementalDetokenizer, find_stop


CPU_KV_CACHE_CAP_BYTES = 2 << 30
STAGE_LOOKAHEAD = 256  # waiting requests looked through for the adapters to stage next

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One request's news about one new token (a step with accepted drafts gives a request several, in
    order), and the result when finished."""

    request_id: str
    token: TokenInfo | None
    finished: bool = False
    finish_reason: FinishReason | None = None
    generated_text: str | None = None  # when finished: the whole text, stop sequence cut
    token_ids: list[int] | None = None  # when finished: every generated token id
    prompt_tokens: list[TokenInfo] | None = None  # when finished and prompt logprobs were asked for
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    token_times: list[float] | None = None  # when finished: when each generated token was made (monotonic)
    error: str | None = None  # set (with finished=True) when the request failed; the text says why


@dataclass
class _Stream:
    """Engine-side per-request state that the scheduler does not need."""

    detokenizer: IncrementalDetokenizer | None
    text_end: int | None = None  # where the stop sequence begins, once matched
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.processor = loaded.processor  # None for text-only models
        self.model_id = loaded.model_id
        self.device, self.dtype = loaded.device, loaded.dtype
        num_blocks = self._kv_cache_blocks(loaded)
        # A model whose cross-attention layers cache only its states (Mllama) keeps them in a pool of their
        # own, as many slots as the token pool: the same memory as one pool whose blocks span every layer,
        # but states no longer take token slots (nor tokens state slots).
        num_state_blocks = num_blocks if getattr(loaded.model, "state_layers", ()) else 0
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_batch_prefill_tokens=config.max_batch_prefill_tokens,
                max_num_seqs=config.max_num_seqs,
                watermark_blocks=max(1, num_blocks // 100),
                num_adapter_slots=config.max_active_adapters,
                adapter_cycle_time_s=config.adapter_cycle_time_s,
                num_state_blocks=num_state_blocks,
                prefix_caching=config.prefix_caching,
            )
        )
        self.lora = LoraSlots(loaded.model, config.max_active_adapters, loaded.device, loaded.dtype, config.max_lora_rank)
        # Adapters of the requests in the engine, with how many requests use each.
        self._adapters: dict[str, tuple[LoraAdapter, int]] = {}
        mc = loaded.config
        encdec = mc.encoder_decoder
        forced = ForcedTokens(encdec.forced_bos_token_id, encdec.forced_eos_token_ids) if encdec else None
        self.runner = ModelRunner(
            loaded.model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks, config.block_size,
            loaded.device, loaded.dtype, lora=self.lora, forced_tokens=forced, num_state_blocks=num_state_blocks,
            graphs=GraphSettings(min(config.max_num_seqs, GRAPH_BATCH_SIZES[-1]), self.max_total_tokens)
            if config.cuda_graphs else None,
        )
        if self.runner.decode_graphs is not None:  # a step that admits runs eagerly: joins wait a little (joins.py)
            self.scheduler.joins = WaitingJoins(config.max_waiting_tokens, config.waiting_served_ratio)
        self._streams: dict[str, _Stream] = {}
        self._next_id = 0
        self._grammars: Grammars | None = None  # structured output, made at the first request that asks
        self.spec_decode = SpecDecodeCounters()
        self._grammars_made = threading.Lock()  # compile_grammar is called from other threads too
        overlap = config.overlap_steps
        self._overlap = (self.runner.decode_graphs is not None if overlap is None else overlap) and (
            config.speculative_tokens == 0)
        self._in_flight: InFlight | None = None  # the step launched and not read yet (overlap.py)

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = False, log=None) -> "Engine":
        """Load the model `config` names; `log` (a str -> None callable; default: stderr) hears the progress."""
        extra = {} if log is None else {"log": log}
        return cls(load_model(config, show_progress=show_progress, **extra), config)

    @property
    def warms_up(self) -> bool:
        """Whether `warm_up` is wanted before serving (the config's choice; by default on CUDA)."""
        return self.config.warm_up if self.config.warm_up is not None else self.device.type == "cuda"

    def warm_up(self) -> WarmUpReport:
        """Run made-up requests through the idle engine before the first real one (engine/warm_up.py)."""
        return warm_up(self)

    # ---- capacity ---------------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.scheduler.config.num_blocks * self.scheduler.config.block_size

    @property
    def max_total_tokens(self) -> int:
        """The longest sequence (prompt + generated) one request may reach."""
        return min(self.config.max_total_tokens, self.model_config.max_position_embeddings, self.kv_capacity_tokens)

    def _kv_cache_blocks(self, loaded: LoadedModel) -> int:
        cfg = self.config
        if cfg.max_batch_total_tokens is not None:
            return blocks_for(cfg.max_batch_total_tokens, cfg.block_size)
        mc = loaded.config
        bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * loaded.dtype.itemsize
        if loaded.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(loaded.device)
            free -= (1.0 - cfg.cuda_memory_fraction) * total  # the share of the device not ours
            budget = free * (cfg.kv_cache_memory_fraction or 0.85) - self._reserved_bytes(loaded, total)
        else:  # CPU: host memory is shared with everything else; a modest slice, capped
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(available * (cfg.kv_cache_memory_fraction or 0.1), CPU_KV_CACHE_CAP_BYTES)
            if cfg.kv_cache_memory_fraction is None:
                # and no more than the weights: a CPU computes few sequences at once, so a small model needs
                # little cache (the embedded 135M model: ~540 MB, about 11,700 tokens).
                budget = min(budget, sum(p.numel() * p.element_size() for p in loaded.model.parameters()))
        # At least one longest request.
        tokens = max(cfg.max_total_tokens, int(budget) // bytes_per_token)
        return blocks_for(tokens, cfg.block_size)

    def _reserved_bytes(self, loaded: LoadedModel, total: int) -> int:
        """CUDA memory kept out of the KV cache: the adapters' slots (every linear at the largest rank, for every
        slot, at most `adapter_memory_fraction` of the device) and the decode graphs' activations and logits (at
        their largest batch, counted in float32 to be safe)."""
        cfg, mc = self.config, loaded.config
        linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
        per_slot = sum(m.in_features + m.out_features for m in linears) * cfg.max_lora_rank * loaded.dtype.itemsize
        adapters = min(cfg.max_active_adapters * per_slot, int(cfg.adapter_memory_fraction * total))
        graphs = 0
        if cfg.cuda_graphs:
            row = mc.vocab_size + 4 * mc.intermediate_size + 8 * mc.hidden_size + 64 * mc.num_heads * mc.head_dim
            graphs = min(cfg.max_num_seqs, GRAPH_BATCH_SIZES[-1]) * row * 4
        return adapters + graphs

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        adapter: LoraAdapter | None = None, images: ImageInputs | None = None,
    ) -> Request:
        """Queue a request; `adapter` (loaded, e.g. by an AdapterStore) or None for the base model;
        `images` for a model that takes them (already expanded into placeholder tokens in the prompt)."""
        if not prompt_ids:
            raise RequestRefused("the prompt is empty")
        if images is not None:
            self._check_images(prompt_ids, images)
        elif self.image_token_id is not None and self.image_token_id in prompt_ids:
            raise RequestRefused("the prompt has image tokens but no images came with it")
        if len(prompt_ids) > self.config.max_input_length:
            raise RequestRefused(
                f"prompt has {len(prompt_ids)} tokens; must be <= {self.config.max_input_length} (max input length)"
            )
        # Before `images` is replaced below (a copy would hash the pixels again on this thread).
        image_digest = images.digest if images is not None and self.config.prefix_caching else b""
        encoder_ids, num_states = None, 0
        if self.is_encoder_decoder:  # the prompt is the encoder's input; the decoder starts from one token
            encoder_ids, prompt_ids = list(prompt_ids), [self.model_config.encoder_decoder.decoder_start_token_id]
            self._check_encoder_input(encoder_ids)
            num_states = len(encoder_ids)  # one state per encoder token
        if images is not None and self.model_config.mllama is not None:
            images = with_state_layout(
                images, len(prompt_ids), self.model_config.mllama.vision.max_num_tiles, self.runner.model.states_per_tile
            )
            num_states = images.layout.num_states
        if num_states:
            self._check_states_fit(num_states, len(prompt_ids), params)
        limit = self.max_total_tokens
        if len(prompt_ids) + params.max_new_tokens > limit:
            raise RequestRefused(
                f"prompt tokens ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                f"must be <= {limit} (max total tokens)"
            )
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(
            request_id, list(prompt_ids), params, seed, time.monotonic(), images=images, encoder_ids=encoder_ids,
            num_states=num_states,
        )
        if params.grammar is not None:
            request.grammar = self._grammar_matcher(params.grammar)
        if adapter is not None:
            self._use_adapter(adapter)
            request.adapter_id = adapter.key  # the engine's name for it; `adapter.adapter_id` is the client's
        if self.config.prefix_caching:
            request.cache_key = root_key(adapter.fingerprint if adapter else None, params.cache_salt, encoder_ids)
            request.image_digest = image_digest
        detok = (
            IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            if self.tokenizer is not None
            else None
        )
        self.scheduler.add(request)
        self._streams[request_id] = _Stream(detok)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.get(request_id)
        self._streams.pop(request_id, None)
        if request is None:
            return False
        self._release(request, FinishReason.ABORTED)
        return True

    def _release(self, request: Request, reason: FinishReason) -> None:
        """A request leaves the engine: its KV blocks, adapter use, stream and per-request states go."""
        self.scheduler.finish(request, reason)
        drop_placeholders(request)
        self._drop_adapter(request.adapter_id)
        self._streams.pop(request.request_id, None)
        self.runner.forget(request.request_id)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.model_config.encoder_decoder is not None

    def sequence_tokens_of_prompt(self, num_prompt_tokens: int) -> int:
        """How much of a sequence's max total tokens a prompt takes: all of it for a decoder; for an
        encoder-decoder model only the decoder's start token (the prompt is the encoder's input)."""
        return 1 if self.is_encoder_decoder else num_prompt_tokens

    def _check_encoder_input(self, encoder_ids: list[int]) -> None:
        """The encoder input must fit the model's positions."""
        most = self.model_config.encoder_decoder.max_source_positions
        if most is not None and len(encoder_ids) > most:
            raise RequestRefused(f"prompt has {len(encoder_ids)} tokens; the model's encoder takes at most {most}")

    def _check_states_fit(self, num_states: int, prompt_tokens: int, params: SamplingParams) -> None:
        """A request's cross-attention states and its longest sequence must fit the KV cache (the states take
        blocks of it too, of the token pool or of their own)."""
        bs = self.scheduler.config.block_size
        state_blocks, token_blocks = blocks_for(num_states, bs), blocks_for(prompt_tokens + params.max_new_tokens, bs)
        if not self.scheduler.fits_alone(token_blocks, state_blocks):
            source = "of its images" if self.model_config.mllama is not None else "of its prompt, the encoder's input"
            config = self.scheduler.config
            capacity = (f"{config.num_blocks * bs} token slots and {config.num_state_blocks * bs} state slots"
                        if config.num_state_blocks else f"{self.kv_capacity_tokens} slots")
            raise RequestRefused(
                f"the request's {num_states} cross-attention states ({source}) and its {prompt_tokens} tokens + "
                f"max_new_tokens ({params.max_new_tokens}) do not fit the KV cache ({capacity})"
            )

    @property
    def takes_images(self) -> bool:
        return self.runner.takes_images

    @property
    def image_token_id(self) -> int | None:
        """The token that stands for an image in a prompt (None: the model takes no images)."""
        config = self.model_config
        if config.mllama is not None:
            return config.mllama.image_token_id
        return config.vision.image_token_id if config.vision is not None else None

    def _check_images(self, prompt_ids: list[int], images: ImageInputs) -> None:
        if not self.takes_images:
            raise RequestRefused(f"model {self.model_id!r} does not take images (it is a text-only model)")
        if not images.positions or images.positions[-1] >= len(prompt_ids) or images.num_images == 0:
            raise RequestRefused("the images have no placeholder tokens in the prompt")

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` into the grammar cache, from any thread: the server calls this off the engine thread
        before it queues the request, so that `add_request` only copies the compiled grammar. Raises
        RequestRefused naming the problem (unusable, or over a limit)."""
        self._compiled_grammar(spec)

    def _grammar_matcher(self, spec: GrammarSpec):
        return self._compiled_grammar(spec).deep_copy()

    def _compiled_grammar(self, spec: GrammarSpec):
        if self.tokenizer is None:
            raise RequestRefused("structured output needs the model's tokenizer")
        with self._grammars_made:
            if self._grammars is None:
                config = self.model_config
                limits = GrammarLimits(self.config.max_grammar_bytes, self.config.grammar_compile_timeout_s)
                self._grammars = Grammars(
                    self.tokenizer.hf, config.vocab_size, tuple(self.tokenizer.eos_token_ids), limits
                )
                self.runner.grammar_masks = GrammarMasks(config.vocab_size)
        try:
            return self._grammars.compile(spec)
        except GrammarTooCostly as exc:
            raise RequestRefused(f"grammar refused: {exc}") from exc
        except GrammarError as exc:
            raise RequestRefused(f"invalid grammar: {exc}") from exc

    def _use_adapter(self, adapter: LoraAdapter) -> None:
        unknown = set(adapter.modules) - set(self.lora.layers)
        if unknown:
            raise RequestRefused(f"adapter {adapter.adapter_id!r} targets modules this model lacks: {sorted(unknown)[:3]}")
        _, users = self._adapters.get(adapter.key, (adapter, 0))
        self._adapters[adapter.key] = (adapter, users + 1)

    def _drop_adapter(self, adapter_id: str | None) -> None:
        if adapter_id is None:
            return
        adapter, users = self._adapters[adapter_id]
        if users == 1:
            del self._adapters[adapter_id]
        else:
            self._adapters[adapter_id] = (adapter, users - 1)

    @property
    def adapter_ids(self) -> dict[str, list[str]]:
        """Distinct adapters of running and of waiting requests (for metrics)."""
        # Copies first: metrics read this from another thread while the engine thread runs.
        adapters = dict(self._adapters)

        def names(requests: list[Request]) -> list[str]:  # by the adapters' ids, not their keys
            return sorted({adapters[r.adapter_id][0].adapter_id for r in requests if r.adapter_id in adapters})

        return {"running": names(list(self.scheduler.running)), "waiting": names(list(self.scheduler.waiting))}

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    @property
    def step_in_flight(self) -> bool:
        """Whether the last `step` left its step launched on the device (overlap.py), its tokens read by the next."""
        return self._in_flight is not None

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan a step and run it. With overlapped steps (overlap.py) a decode step is launched and its tokens are
        read at the next call, after the step that follows it is launched; a step that cannot be launched so
        first reads the one in flight, then runs as before."""
        plan = self.scheduler.schedule()
        landing, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if plan.scheduled:
            started = time.monotonic()
            outputs = self._install(plan)
            for item in plan.scheduled:  # queue time ends when a request's first step begins
                if item.request.first_scheduled_time is None:
                    item.request.first_scheduled_time = started
        if (self._adapters and self.scheduler.waiting) or self.lora.staged:
            self._stage_next_installs()  # while this step runs (a base-model queue has nothing to stage)
        if plan.scheduled and self._overlap and self.runner.launchable(plan.scheduled):
            self._in_flight = self._launch(plan, landing)
        if landing is not None:
            outputs += self._land(landing)
        if self._in_flight is None:  # not launched: it runs now
            if landing is not None:  # without the requests that ended when the step in flight was read
                plan.scheduled = [item for item in plan.scheduled if not item.request.finished]
            if plan.scheduled:
                outputs += self._execute(plan)
        return outputs

    def _execute(self, plan: SchedulerOutput) -> list[RequestOutput]:
        try:
            results = self.runner.execute(plan.scheduled, plan.fresh_blocks, plan.fresh_state_blocks)
        except Exception as error:  # noqa: BLE001 — contained: only the requests it belongs to fail
            results = execute_contained(self.runner.execute, plan.scheduled, error, self.scheduler.config.block_size,
                                        plan.fresh_blocks, plan.fresh_state_blocks)
        return self._update(plan, results)

    def _launch(self, plan: SchedulerOutput, after: InFlight | None) -> InFlight | None:
        """Launch the step; None when the launch failed (the step then runs as before, and its failure is
        contained there)."""
        try:
            launched = self.runner.launch(plan.scheduled, plan.fresh_blocks, plan.fresh_state_blocks,
                                          after.launched if after else None)
        except Exception:  # noqa: BLE001
            log.warning("launching a decode step failed; it runs without overlap", exc_info=True)
            return None
        return in_flight(plan, launched, self.max_total_tokens)

    def _land(self, step: InFlight) -> list[RequestOutput]:
        """Read a launched step's tokens into its requests (those that left the engine meanwhile are skipped)."""
        results = self.runner.land(step.launched)
        now = time.monotonic()
        outputs = []
        for item, result, place, computed in zip(step.plan.scheduled, results, step.places, step.computed):
            request = item.request
            if request.finished:  # aborted, or ended when the step before was read
                continue
            if result.error is not None:
                request.num_computed_tokens = computed  # what this step wrote is not kept (nor cached)
                outputs.append(self._fail(request, result.error))
            else:
                outputs.append(self._append_token(request, result.tokens[0], now, place))
        return outputs

    def _install(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Install the step's new adapters into their slots. An adapter whose install raises fails the step's
        requests for it and leaves its slot empty (a later request for it installs it again); requests that
        read blocks they were to write are requeued (containment.py); the rest of the step runs."""
        broken: dict[str, str] = {}
        with self.lora.installs():
            for slot, key in plan.installs:
                adapter = self._adapters[key][0]
                try:
                    self.lora.install(slot, adapter)
                except Exception as error:  # noqa: BLE001
                    log.error("installing adapter %r failed: %r", adapter.adapter_id, error)
                    self.lora.clear(slot)  # an install stopped half way must leave nothing behind
                    broken[key] = f"adapter {adapter.adapter_id!r} could not be installed: {error}"
        if not broken:
            return []
        writers = writers_of(plan.scheduled, self.scheduler.config.block_size)
        results = [StepResult() for _ in plan.scheduled]
        for i, item in enumerate(plan.scheduled):
            if item.request.adapter_id in broken:
                results[i].error = broken[item.request.adapter_id]
            elif any(results[w].error or results[w].requeue for w in writers[i]):
                results[i].requeue = True
        outputs = self._settle(plan.scheduled, results)
        plan.scheduled = [item for item, result in zip(plan.scheduled, results) if not (result.error or result.requeue)]
        for adapter_id in broken:  # its requests are gone, so nothing pins it: free its slot
            self.evict_adapter(adapter_id)
        return outputs

    def evict_adapter(self, key: str) -> None:
        """Take the adapter `key` out of its device slot now, if it has one; no request may be using it."""
        slot = self.scheduler.slots.slot_of(key)
        if slot is not None:
            self.scheduler.slots.evict(key)
            self.lora.clear(slot)

    def _stage_next_installs(self) -> None:
        """Have the adapters that the waiting queue wants next, and no slot holds, laid out ahead of their
        installs (lora/staging.py); in queue order, as the scheduler admits. The queue is read only as far as the
        staging budget reaches (repeats are yielded; `stage_ahead` skips them)."""
        slots = self.scheduler.slots

        def wanted():
            for request in itertools.islice(self.scheduler.waiting, STAGE_LOOKAHEAD):
                key = request.adapter_id
                if key is not None and slots.slot_of(key) is None:
                    yield self._adapters[key][0]

        self.lora.stage_ahead(wanted())

    def _settle(self, scheduled: list[ScheduledRequest], results: list[StepResult]) -> list[RequestOutput]:
        """Fail the requests whose result is an error and requeue those to be requeued (in step order: a writer
        before its readers)."""
        outputs = []
        for item, result in zip(scheduled, results):
            if result.error is not None:
                outputs.append(self._fail(item.request, result.error))
            elif result.requeue:
                self.scheduler.requeue(item.request)
        return outputs

    def _update(self, plan: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = self._settle(plan.scheduled, results)
        for item, result in zip(plan.scheduled, results):
            request = item.request
            if result.error is not None or result.requeue:
                continue
            if result.prompt_logprobs:
                request.prompt_logprobs = (request.prompt_logprobs or []) + result.prompt_logprobs
            rejected = 0
            if item.num_drafts:
                accepted = len(result.tokens) - 1
                self.spec_decode.record(item.num_drafts, accepted)
                rejected = item.num_drafts - accepted
            # The last token kept is not computed yet; rejected drafts' keys and values stay in the cache past
            # num_computed_tokens, where nothing reads them before they are overwritten.
            request.num_computed_tokens += item.num_new_tokens - rejected
            request.states_ready = bool(request.num_states)  # made by its first step, if it has any
            for token in result.tokens:  # one by one, as decoding without drafts: a stop drops those after it
                output = self._append_token(request, token, now)
                outputs.append(output)
                if output.finished:
                    break
        self._propose_drafts(plan)
        return outputs

    def _propose_drafts(self, plan: SchedulerOutput) -> None:
        """Drafts for the next step of each request still decoding (engine/speculative.py)."""
        most = self.config.speculative_tokens
        if most <= 0:
            return
        for item in plan.scheduled:
            request = item.request
            if request.status is RequestStatus.RUNNING and request.num_uncomputed_tokens == 1:
                request.draft_ids = drafts_for(request, most, self.max_total_tokens)

    def _append_token(self, request: Request, result: SampledToken, now: float, place: int | None = None) -> RequestOutput:
        """`place`: the index of the token's placeholder in output_ids (overlap.py); None: appended."""
        token_id = result.token_id
        stream = self._streams[request.request_id]
        stream.first_token_time = stream.first_token_time or now
        stream.token_times.append(now)
        if place is None:
            request.output_ids.append(token_id)
        else:
            assert request.output_ids[place] == PENDING, "a placeholder is written once"
            request.output_ids[place] = token_id
            request.num_pending -= 1
        if request.grammar is not None:
            error = advance(request.grammar, token_id)
            if error is not None:
                return self._fail(request, error)
        piece = stream.detokenizer.add(token_id) if stream.detokenizer else ""
        token = TokenInfo(
            id=token_id,
            text=piece,
            logprob=result.logprob,
            special=self.tokenizer.is_special(token_id) if self.tokenizer else False,
            top_tokens=[self._token_info(t, lp) for t, lp in result.top_tokens],
        )
        reason = self._finish_reason(request, token_id, piece, stream)
        if reason is None:
            return RequestOutput(request.request_id, token, seed=request.seed)
        if reason is not FinishReason.STOP_SEQUENCE and stream.detokenizer is not None:
            token.text += stream.detokenizer.flush()  # bytes held back for an unfinished character
        self._release(request, reason)
        return self._final_output(request, token, stream, now)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """End a request whose computation failed; its KV blocks and adapter use are released."""
        self._release(request, FinishReason.ABORTED)
        return RequestOutput(request.request_id, None, finished=True, seed=request.seed, error=message)

    def _finish_reason(self, request: Request, token_id: int, piece: str, stream: _Stream) -> FinishReason | None:
        params = request.params
        eos_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset(self.model_config.eos_token_ids)
        if (token_id in eos_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return FinishReason.EOS_TOKEN
        if request.grammar is not None and request.grammar.is_stopped():  # complete, its end token taken
            return FinishReason.EOS_TOKEN
        if params.stop and stream.detokenizer is not None:
            stop_at = find_stop(stream.detokenizer.text, len(piece), params.stop)
            if stop_at is not None:
                stream.text_end = stop_at
                return FinishReason.STOP_SEQUENCE
        if len(request.output_ids) >= params.max_new_tokens or request.num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _final_output(self, request: Request, token: TokenInfo, stream: _Stream, now: float) -> RequestOutput:
        text = stream.detokenizer.text[: stream.text_end] if stream.detokenizer else ""
        prompt_tokens = None
        # An encoder's input is encoded, not predicted: it has no logprobs (None: the caller says so).
        if request.params.prompt_logprobs and request.prompt_logprobs is not None and request.encoder_ids is None:
            prompt_tokens = [self._token_info(t, lp) for t, lp in zip(request.prompt_ids, request.prompt_logprobs)]
        timings = {
            "queue": (request.first_scheduled_time or now) - request.arrival_time,
            "first_token": (stream.first_token_time or now) - request.arrival_time,
            "total": now - request.arrival_time,
        }
        return RequestOutput(
            request.request_id, token, finished=True, finish_reason=request.finish_reason, generated_text=text,
            token_ids=list(request.output_ids),
            prompt_tokens=prompt_tokens, num_prompt_tokens=request.num_input_tokens,
            num_generated_tokens=len(request.output_ids), seed=request.seed, timings=timings,
            token_times=stream.token_times,
        )

    def _token_info(self, token_id: int, logprob: float | None) -> TokenInfo:
        if self.tokenizer is None:
            return TokenInfo(token_id, "", logprob)
        return TokenInfo(token_id, self.tokenizer.token_text(token_id), logprob, self.tokenizer.is_special(token_id))

    # ---- convenience ------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        adapters: list[LoraAdapter | None] | None = None, images: list[ImageInputs | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (offline use and tests); final outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters or [None] * len(prompts)
        images = images or [None] * len(prompts)
        requests = [self.add_request(p, sp, adapter=a, images=i) for p, sp, a, i in zip(prompts, params_list, adapters, images)]
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[r.request_id] for r in requests]
