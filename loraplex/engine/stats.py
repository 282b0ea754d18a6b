"""What the engine tells the world about itself: an immutable stats snapshot for /metrics, and what an
adapter store needs to know of the base model. The server reads these, never the engine's parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraplex.engine.step_metrics import StepMetricsSnapshot
from loraplex.lora.layout import FlatFormat


@dataclass(frozen=True)
class EngineStats:
    """The engine's queues, caches and counters at one moment. Built on the asking thread from plain reads
    (counters and copies of the queues), while the engine thread may be in a step."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float  # 0..1
    state_cache_usage: float | None  # 0..1 of a pool of image states of its own (Mllama); None: no such pool
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    encoded_images: int | None  # None: a model without a vision tower
    vision_encoder_seconds: float | None
    spec_draft_tokens: int
    spec_accepted_tokens: int
    running_adapters: tuple[str, ...]  # distinct adapters (by the clients' ids) of running requests
    waiting_adapters: tuple[str, ...]
    max_adapters: int  # device slots for adapters
    # LoRAX's reserved max tokens of the running batch: each running request's prompt + max_new_tokens.
    batch_max_tokens: int = 0
    steps: StepMetricsSnapshot = field(default_factory=StepMetricsSnapshot)  # per-step counts (step_metrics.py)


def engine_stats(scheduler, vision_counters, spec_decode, adapter_ids: dict[str, list[str]],
                 steps: StepMetricsSnapshot | None = None) -> EngineStats:
    """The snapshot from the scheduler's counters, the runner's vision counters (None: no vision tower), the
    speculative-decoding counters, the adapters of running and waiting requests and the step recorder's snapshot."""
    separate_states = scheduler.state_allocator is not scheduler.allocator
    running = list(scheduler.running)  # one copy (the engine thread may change the list meanwhile)
    return EngineStats(
        num_waiting=len(scheduler.waiting), num_running=len(running),
        kv_cache_usage=scheduler.allocator.usage,
        state_cache_usage=scheduler.state_allocator.usage if separate_states else None,
        prefix_cache_queries=scheduler.prefix_queries, prefix_cache_hits=scheduler.prefix_hits,
        num_preemptions=scheduler.num_preemptions,
        encoded_images=vision_counters.encoded_images if vision_counters is not None else None,
        vision_encoder_seconds=vision_counters.encode_seconds if vision_counters is not None else None,
        spec_draft_tokens=spec_decode.draft_tokens, spec_accepted_tokens=spec_decode.accepted_tokens,
        running_adapters=tuple(adapter_ids["running"]), waiting_adapters=tuple(adapter_ids["waiting"]),
        max_adapters=scheduler.slots.num_slots,
        batch_max_tokens=sum(r.num_input_tokens + r.params.max_new_tokens for r in running),
        steps=steps if steps is not None else StepMetricsSnapshot(),
    )


@dataclass(frozen=True)
class AdapterTargets:
    """What an adapter store needs of the base model to check and lay out adapters for it."""

    base_shapes: dict[str, tuple[int, int]]  # LoRA-wrapped module -> (in_features, out_features)
    max_rank: int
    base_weight: Callable[[str], torch.Tensor]  # a module's base weight (merges and checks read it)
    checkpoint_name: object | None  # the model's layout mapping, for adapters of another layout (lora/sources/store.py)
    flat_format: FlatFormat = FlatFormat()  # how loaded adapters are kept in host memory for this engine's installs
