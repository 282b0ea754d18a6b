"""The engine: `step()` = schedule -> install adapters -> run -> update.

Synchronous and single-threaded; `AsyncEngine` drives it from a background thread for the server. With
overlapped steps (worker/overlap.py) `step` is the overlapped loop instead: launch this step, then land the
previous. The step's parts live in rooms beside it: requests/ (the request, every input check, outputs),
scheduling/ (scheduler, KV blocks, prefix cache), worker/ (batch, model call, graphs, overlap), sampling/ (the
logits pipeline); and here adapter use and installs (adapters.py), memory sizing (memory.py), fault containment
(containment.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time

from loraplex.checkpoints.pooling_config import default_pooling
from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.containment import execute_contained, failed_install_results
from loraplex.engine.adapters import EngineAdapters
from loraplex.engine.worker.decode_graphs import BATCH_SIZES as GRAPH_BATCH_SIZES
from loraplex.engine.sampling.grammar_masks import GrammarMasks
from loraplex.engine.requests.inputs import GrammarCache, InputLimits, InputProcessor, ProcessedInputs
from loraplex.engine.scheduling.joins import WaitingJoins
from loraplex.engine.loading import LoadedModel, load_model
from loraplex.engine.memory import apply_checkpoint_kv_scales, kv_cache_blocks, kv_cache_dtype
from loraplex.engine.requests.output import OutputProcessor, RequestOutput, Stream, failed_output
from loraplex.engine.worker.overlap import InFlight, drop_placeholders, in_flight
from loraplex.engine.scheduling.prefix_cache import root_key
from loraplex.engine.requests.request import Request
from loraplex.engine.sampling.logits import ForcedTokens
from loraplex.engine.worker.runner import GraphSettings, ModelRunner, StepResult
from loraplex.engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from loraplex.engine.served_model import ServedModel
from loraplex.engine.sampling.speculative import SpecDecodeCounters, propose_drafts
from loraplex.engine.stats import AdapterTargets, EngineStats, engine_stats
from loraplex.engine.step_metrics import StepMetrics
from loraplex.engine.sampling.verification import SampledToken
from loraplex.engine.warm_up import WarmUpReport, warm_up
from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.layout import FlatFormat
from loraplex.lora.device.table import AdapterTable
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.params import FinishReason, GrammarSpec, SamplingParams
from loraplex.quantization import graph_blocker

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096  # TGI's, where the model's context allows it


class LengthsError(ValueError):
    """Lengths (max_input_length, max_total_tokens) this model or KV cache cannot serve: one line at start-up."""


def _enable_grammar_masks(runner: ModelRunner, vocab_size: int) -> None:
    runner.grammar_masks = GrammarMasks(vocab_size)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        requested = config
        config = resolve_lengths(_fit_to_rope(config, loaded.config), loaded.config.max_position_embeddings)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.processor = loaded.processor  # None for text-only models
        self.pooling = loaded.pooling or default_pooling(loaded.config.encoder_decoder is not None)  # embeddings
        self.model_id = loaded.model_id
        self.device, self.dtype = loaded.device, loaded.dtype
        self.kv_cache_dtype = kv_cache_dtype(config, loaded)
        num_blocks = kv_cache_blocks(config, loaded, self.kv_cache_dtype)
        # One request at its longest fits the cache (smaller only when max_batch_total_tokens sets its size).
        config = resolve_lengths(config, num_blocks * config.block_size, requested,
                                 "the KV cache's {} tokens (--max-batch-total-tokens)")
        self.config = config  # max_total_tokens and max_input_length as served
        # A model whose cross-attention layers cache only its states (Mllama) keeps them in a pool of their
        # own, as many slots as the token pool: the same memory as one pool whose blocks span every layer,
        # but states no longer take token slots (nor tokens state slots).
        num_state_blocks = num_blocks if loaded.model.state_layers else 0
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
                recompute_after=_longrope_recompute_length(loaded.config),
            )
        )
        self.lora = AdapterTable(loaded.model, config.max_active_adapters, loaded.device, loaded.dtype, config.max_lora_rank)
        self.adapters = EngineAdapters(self.lora, self.scheduler)
        mc = loaded.config
        encdec = mc.encoder_decoder
        forced = ForcedTokens(encdec.forced_bos_token_id, encdec.forced_eos_token_ids) if encdec else None
        graphed = config.cuda_graphs and _graphs_allowed(loaded)
        self.runner = ModelRunner(
            loaded.model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks, config.block_size,
            loaded.device, loaded.dtype, lora=self.lora, forced_tokens=forced, num_state_blocks=num_state_blocks,
            graphs=GraphSettings(min(config.max_num_seqs, GRAPH_BATCH_SIZES[-1]), self.max_total_tokens)
            if graphed else None, kv_cache_dtype=self.kv_cache_dtype,
        )
        apply_checkpoint_kv_scales(self, loaded)
        if self.runner.decode_graphs is not None:  # a step that admits runs eagerly: joins wait a little (joins.py)
            self.scheduler.joins = WaitingJoins(config.max_waiting_tokens, config.waiting_served_ratio)
        # At the first grammar the runner starts masking rows by their grammars (a function of the runner, not a
        # method of the engine: nothing the engine holds refers back to it).
        masks = functools.partial(_enable_grammar_masks, self.runner, mc.vocab_size)
        grammars = GrammarCache(self.tokenizer, mc, config, on_first=masks)
        limits = InputLimits(self.model_id, config.max_input_length, self.max_total_tokens, self.is_encoder_decoder,
                             self.runner.takes_images)
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_total_tokens)
        self.inputs = InputProcessor(
            mc, config, self.scheduler, limits=limits, lora_modules=self.lora.layers, grammars=grammars,
            states_per_tile=self.runner.model.states_per_tile if mc.mllama is not None else None,
            eos_token_ids=tuple(self.outputs.eos_token_ids),
        )
        self._next_id = 0
        self.spec_decode = SpecDecodeCounters()
        self.step_metrics = StepMetrics()  # LoRAX's batch metrics (engine/step_metrics.py)
        overlap = config.overlap_steps
        self._overlap = (self.runner.decode_graphs is not None if overlap is None else overlap) and (
            config.speculative_tokens == 0)
        self._in_flight: InFlight | None = None  # the step launched and not read yet (worker/overlap.py)

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

    def set_kv_scales(self, scales) -> None:
        """An FP8 KV cache's calibrated scales, {layer index: (k_scale, v_scale)} (layers/kv_quant.py), before the
        first request (ValueError when the cache is not FP8)."""
        self.runner.set_kv_scales(scales)

    # ---- capacity ---------------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.scheduler.config.num_blocks * self.scheduler.config.block_size

    @property
    def max_total_tokens(self) -> int:
        """The longest sequence (prompt + generated) one request may reach (within the context and the KV cache)."""
        return self.config.max_total_tokens

    @property
    def is_encoder_decoder(self) -> bool:
        return self.model_config.encoder_decoder is not None

    @property
    def takes_images(self) -> bool:
        return self.runner.takes_images

    # ---- what the server reads ------------------------------------------------------------------

    def describe(self) -> ServedModel:
        """The served model as the server may know it (fixed from here on)."""
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        return ServedModel(
            model_id=self.model_id, model_type=self.model_config.model_type, tokenizer=self.tokenizer,
            processor=self.processor, device_type=self.device.type, dtype=name(self.dtype),
            kv_cache_dtype=name(self.kv_cache_dtype), limits=self.inputs.limits,
            kv_capacity_tokens=self.kv_capacity_tokens, bos_token_id=self.model_config.bos_token_id,
            sampling_defaults=self.model_config.sampling_defaults, settings=self.config,
            adapter_targets=self.adapter_targets(), pooling=self.pooling,
        )

    def stats(self) -> EngineStats:
        """A snapshot of the queues, caches and counters, from any thread (engine/stats.py)."""
        return engine_stats(self.scheduler, self.runner.vision_counters, self.spec_decode, self.adapter_ids,
                            self.step_metrics.snapshot)

    @property
    def adapter_ids(self) -> dict[str, list[str]]:
        """Distinct adapters of running and of waiting requests (for metrics)."""
        return self.adapters.adapter_ids()

    def adapter_targets(self) -> AdapterTargets:
        """What an adapter store needs of this model: the wrapped modules' shapes and base weights, the
        checkpoint's names for them, the largest rank a slot holds."""
        layers = self.lora.layers
        return AdapterTargets(
            self.lora.base_shapes, self.config.max_lora_rank, base_weight=lambda m: layers[m].weight,
            checkpoint_name=getattr(self.runner.model, "checkpoint_name", None),
            flat_format=FlatFormat(self.dtype, pinned=self.device.type == "cuda"),
        )

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` into the grammar cache, from any thread: the server calls this off the engine thread
        before it queues the request, so that `add_request` only copies the compiled grammar. Raises
        RequestRefused naming the problem (unusable, or over a limit)."""
        self.inputs.grammars.compile(spec)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        adapter: LoraAdapter | None = None, images: ImageInputs | None = None,
    ) -> Request:
        """Queue a request; `adapter` (loaded, e.g. by an AdapterStore) or None for the base model;
        `images` for a model that takes them (already expanded into placeholder tokens in the prompt).
        Raises RequestRefused (engine/requests/inputs.py) when the request cannot be served as asked."""
        return self._queue(self.inputs.process(prompt_ids, params, adapter, images), request_id)

    def _queue(self, inputs: ProcessedInputs, request_id: str | None) -> Request:
        params, adapter = inputs.params, inputs.adapter
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(
            request_id, inputs.prompt_ids, params, seed, time.monotonic(), images=inputs.images,
            encoder_ids=inputs.encoder_ids, num_states=inputs.num_states,
        )
        request.grammar = inputs.grammar
        if adapter is not None:
            self.adapters.use(adapter)
            request.adapter_key = adapter.key  # the store's name for it; `adapter.adapter_id` is the client's
        if self.config.prefix_caching:
            request.cache_key = root_key(adapter.cache_identity if adapter else None, params.cache_salt, inputs.encoder_ids)
            request.image_digest = inputs.image_digest
        self.scheduler.add(request)
        self.outputs.open(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.get(request_id)
        self.outputs.close(request_id)
        if request is None:
            return False
        self._release(request, FinishReason.ABORTED)
        return True

    def _release(self, request: Request, reason: FinishReason) -> Stream | None:
        """A request leaves the engine: its KV blocks, adapter use, stream and per-request states go. Returns
        its stream (None once gone)."""
        self.scheduler.finish(request, reason)
        drop_placeholders(request)
        self.adapters.drop(request.adapter_key)
        self.runner.forget(request.request_id)
        return self.outputs.close(request.request_id)

    def retire_adapter(self, key: str) -> None:
        """No new request will name the adapter `key` (its name was unloaded or replaced): its slot is freed once
        the requests that use it are gone."""
        self.adapters.retire(key)
        if self._in_flight is None:  # no step reads the slots now: free it at once if nothing uses it
            self.adapters.free_retired()

    def hold_adapter(self, key: str) -> None:
        """The adapter `key` keeps its device slot once it has one (a pinned run-time load), until it is retired."""
        if not self.scheduler.slots.hold(key):
            log.warning("adapter %r is not pinned: all but one of the adapter slots are pinned already", key)

    def evict_adapter(self, key: str) -> None:
        """Take the adapter `key` out of its device slot now, if it has one; no request may be using it."""
        self.adapters.evict(key)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    @property
    def step_in_flight(self) -> bool:
        """Whether the last `step` left its step launched on the device (worker/overlap.py), its tokens read by the next."""
        return self._in_flight is not None

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan a step and run it (the overlapped loop when the engine was made with overlapped steps)."""
        self.adapters.free_retired()
        with self.step_metrics.step():  # counted once `_begin` names what it runs
            return self._overlapped_step() if self._overlap else self._plain_step()

    def _plain_step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        outputs = self._begin(plan)
        self.adapters.stage_next_installs()  # while this step runs
        if plan.scheduled:
            outputs += self._execute(plan)
        return outputs

    def _overlapped_step(self) -> list[RequestOutput]:
        """A decode step is launched and its tokens are read at the next call, after the step that follows it is
        launched; a step that cannot be launched so first reads the one in flight, then runs as a plain step."""
        plan = self.scheduler.schedule()
        landing, self._in_flight = self._in_flight, None
        outputs = self._begin(plan)
        self.adapters.stage_next_installs()  # while this step runs
        if plan.scheduled and self.runner.launchable(plan.scheduled):
            self._in_flight = self._launch(plan, landing)
        if landing is not None:
            outputs += self._land(landing)
        if self._in_flight is None:  # not launched: it runs now
            if landing is not None:  # without the requests that ended when the step in flight was read
                plan.scheduled = [item for item in plan.scheduled if not item.request.finished]
            if plan.scheduled:
                outputs += self._execute(plan)
        return outputs

    def _begin(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Install the step's adapters; queue time ends for requests whose first step this is."""
        if not plan.scheduled:
            return []
        started = time.monotonic()
        outputs = self._install(plan)
        self.step_metrics.begin(plan.scheduled)
        for item in plan.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = started
        return outputs

    def _execute(self, plan: SchedulerOutput) -> list[RequestOutput]:
        try:
            results = self.runner.execute(plan.scheduled, plan.fresh_blocks, plan.fresh_state_blocks)
        except Exception as error:  # noqa: BLE001 — contained: only the requests it belongs to fail
            self.step_metrics.failed()
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
        requests for it and leaves its slot empty; requests that read blocks they were to write are requeued
        (containment.py); the rest of the step runs."""
        broken = self.adapters.install(plan.installs)
        if not broken:
            return []
        results = failed_install_results(plan.scheduled, broken, self.scheduler.config.block_size)
        outputs = self._settle(plan.scheduled, results)
        plan.scheduled = [item for item, result in zip(plan.scheduled, results) if not (result.error or result.requeue)]
        for key in broken:  # its requests are gone, so nothing pins it: free its slot
            self.evict_adapter(key)
        return outputs

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
            if result.embedding is not None:  # an embedding request's prompt is complete: it ends with its vector
                stream = self._release(request, FinishReason.LENGTH)
                outputs.append(self.outputs.final_output(request, None, stream, now, result.embedding))
            for token in result.tokens:  # one by one, as decoding without drafts: a stop drops those after it
                output = self._append_token(request, token, now)
                outputs.append(output)
                if output.finished:
                    break
        if self.config.speculative_tokens > 0:
            propose_drafts([item.request for item in plan.scheduled], self.config.speculative_tokens,
                           self.max_total_tokens)
        return outputs

    def _append_token(self, request: Request, result: SampledToken, now: float, place: int | None = None) -> RequestOutput:
        """`place`: the index of the token's placeholder in output_ids (worker/overlap.py); None: appended."""
        appended = self.outputs.append(request, result, now, place)
        if appended.error is not None:
            return self._fail(request, appended.error)
        if appended.finish is None:
            return RequestOutput(request.request_id, appended.token, seed=request.seed)
        stream = self._release(request, appended.finish)
        return self.outputs.final_output(request, appended.token, stream, now)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """End a request whose computation failed; its KV blocks and adapter use are released."""
        self._release(request, FinishReason.ABORTED)
        return failed_output(request, message)

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


def _graphs_allowed(loaded: LoadedModel) -> bool:
    """Whether the model's decode steps can be captured; if not (a quantization that reads the device on the
    host), the engine runs them eagerly and says so once."""
    blocker = graph_blocker(loaded.model)
    if blocker is not None and loaded.device.type == "cuda":
        log.warning("decode steps run without CUDA graphs: %s", blocker)
    return blocker is None


def _fit_to_rope(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """Prefix caching off where a key's rotation depends on its sequence's length (dynamic NTK, LongRoPE): a block
    cached by a shorter sequence would hold keys rotated as no longer sequence rotates them."""
    if config.prefix_caching and model.rope.kind in ("dynamic", "longrope"):
        log.info("prefix caching off: %s RoPE rotates a sequence's keys by its length", model.rope.kind)
        return dataclasses.replace(config, prefix_caching=False)
    return config


def resolve_lengths(config: EngineConfig, limit: int, given: EngineConfig | None = None,
                    limit_name: str = "the model's context of {} tokens (max_position_embeddings)") -> EngineConfig:
    """`config` with max_total_tokens and max_input_length within `limit` tokens (the model's context, then the KV
    cache), those not `given` (default: `config`'s own) derived as TGI does: max_total_tokens config's (none: 4096)
    within the limit, or max_input_length + 1 where more; max_input_length max_total_tokens - 1. Given lengths the
    limit cannot hold: LengthsError."""
    given = given or config
    longest, fixed = given.max_input_length, given.max_total_tokens is not None
    total = given.max_total_tokens if fixed else min(config.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS, limit)
    if longest is not None and longest >= total:
        if fixed:  # TGI refuses it too
            raise LengthsError(f"--max-input-length ({longest}) must be < --max-total-tokens ({total}): a prompt "
                               f"that long leaves no room for a generated token")
        total = longest + 1
    if total > limit:
        what = f"--max-total-tokens ({total}) is more than" if fixed else f"--max-input-length ({longest}) must be <"
        raise LengthsError(f"{what} {limit_name.format(limit)}")
    return dataclasses.replace(config, max_total_tokens=total, max_input_length=total - 1 if longest is None else longest)


def _longrope_recompute_length(model: ModelConfig) -> int | None:
    """LongRoPE (Phi-3): a sequence outgrowing its original context is recomputed with the long factors, as
    transformers re-encodes it then; the scheduler requeues it at that step."""
    return model.rope.original_max_position_embeddings if model.rope.kind == "longrope" else None
