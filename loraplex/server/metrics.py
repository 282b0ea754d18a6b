"""Prometheus metrics under LoRAX's names, plus the vLLM gauges that the Kubernetes Gateway API
Inference Extension reads for routing.

LoRAX's counters are exposed under their exact names (`lorax_request_count`, not `..._total`), so they
are registered as gauges that only ever go up: dashboards built for LoRAX work unchanged.
Engine-state gauges are read at scrape time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.server import request_log

if TYPE_CHECKING:
    from loraplex.engine.engine import Engine, RequestOutput

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BASE_ADAPTER = "base"  # the `adapter` label of requests served by the base model
MAX_ADAPTER_LABELS = 100  # distinct `adapter` label values; later adapters are counted as "other"
OTHER_ADAPTERS = "other"


class Metrics:
    def __init__(self, engine: "Engine") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_count = Gauge("lorax_request_count", "Requests received", ["adapter"], registry=r)
        self.request_success = Gauge("lorax_request_success", "Requests that finished", ["adapter"], registry=r)
        self.request_failure = Gauge("lorax_request_failure", "Requests that failed", ["err"], registry=r)
        self.duration = Histogram("lorax_request_duration", "End-to-end seconds", buckets=DURATION_BUCKETS, registry=r)
        self.queue_duration = Histogram(
            "lorax_request_queue_duration", "Seconds waiting before the first step", buckets=DURATION_BUCKETS, registry=r
        )
        self.inference_duration = Histogram(
            "lorax_request_inference_duration", "Seconds from first step to finish", buckets=DURATION_BUCKETS, registry=r
        )
        self.time_per_token = Histogram(
            "lorax_request_mean_time_per_token_duration", "Mean seconds per generated token",
            buckets=PER_TOKEN_BUCKETS, registry=r,
        )
        self.generated_tokens = Histogram(
            "lorax_request_generated_tokens", "Generated tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.input_length = Histogram(
            "lorax_request_input_length", "Prompt tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.images = Counter("loraplex_images", "Images received in requests", registry=r)
        self.image_processing = Histogram(
            "loraplex_image_processing_seconds", "Seconds the processor took per request's images (resize, tile)",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self._adapter_labels: set[str] = {BASE_ADAPTER}
        r.register(_EngineGauges(engine))

    def _label(self, adapter: str) -> str:
        """The adapter as the client named it (the request's record; else the store's key), with bounded
        cardinality: the first MAX_ADAPTER_LABELS adapters seen get their own label."""
        record = request_log.current()
        if record is not None and record.adapter:
            adapter = record.adapter
        if adapter not in self._adapter_labels and len(self._adapter_labels) >= MAX_ADAPTER_LABELS:
            return OTHER_ADAPTERS
        self._adapter_labels.add(adapter)
        return adapter

    def on_request(self, num_prompt_tokens: int, adapter: str = BASE_ADAPTER) -> None:
        self.request_count.labels(self._label(adapter)).inc()
        self.input_length.observe(num_prompt_tokens)
        if (record := request_log.current()) is not None:
            record.started_run(num_prompt_tokens)

    def on_success(self, final: "RequestOutput", adapter: str = BASE_ADAPTER) -> None:
        t = final.timings
        self.request_success.labels(self._label(adapter)).inc()
        self.duration.observe(t.get("total", 0.0))
        self.queue_duration.observe(t.get("queue", 0.0))
        self.inference_duration.observe(t.get("total", 0.0) - t.get("queue", 0.0))
        self.generated_tokens.observe(final.num_generated_tokens)
        if final.num_generated_tokens:
            self.time_per_token.observe((t.get("total", 0.0) - t.get("queue", 0.0)) / final.num_generated_tokens)
        if (record := request_log.current()) is not None:
            record.finished_run(final)

    def on_images(self, count: int, seconds: float) -> None:
        self.images.inc(count)
        self.image_processing.observe(seconds)

    def on_failure(self, kind: str) -> None:
        self.request_failure.labels(kind).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineGauges:
    """Scrape-time reads of the engine's queues and KV cache (plain reads of counters; no lock needed)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def collect(self):
        scheduler = self.engine.scheduler
        waiting, running = len(scheduler.waiting), len(scheduler.running)
        usage = scheduler.allocator.usage
        yield _gauge("lorax_queue_length", "Requests waiting", waiting)
        yield _gauge("lorax_batch_current_size", "Requests in the running batch", running)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting", waiting)
        yield _gauge("vllm:num_requests_running", "Requests running", running)
        yield _gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1", usage)
        if scheduler.state_allocator is not scheduler.allocator:  # Mllama: image states in a pool of their own
            yield _gauge("loraplex_state_cache_usage_perc", "Image state cache usage, 0..1", scheduler.state_allocator.usage)
        # vLLM's names, in tokens, so dashboards and routers that read a prefix-cache hit rate read ours.
        yield CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=scheduler.prefix_queries)
        yield CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=scheduler.prefix_hits)
        counters = self.engine.runner.vision_counters
        if counters is not None:
            yield CounterMetricFamily("loraplex_vision_encoded_images", "Images run through the vision tower",
                                      value=counters.encoded_images)
            yield CounterMetricFamily("loraplex_vision_encoder_seconds", "Seconds spent in the vision tower and projector",
                                      value=counters.encode_seconds)
        yield from _spec_decode_counters(self.engine.spec_decode)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Adapters of running and waiting requests",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        adapters = self.engine.adapter_ids
        slots = str(self.engine.scheduler.slots.num_slots)
        info.add_metric([",".join(adapters["running"]), ",".join(adapters["waiting"]), slots], time.time())
        yield info

    def describe(self):
        return []


def _spec_decode_counters(counters):
    """Speculative decoding's drafted and accepted tokens, under loraplex's names and vLLM's (`_total` added)."""
    for prefix in ("loraplex_spec_decode_", "vllm:spec_decode_num_"):
        yield CounterMetricFamily(prefix + "draft_tokens", "Draft tokens the model verified", value=counters.draft_tokens)
        yield CounterMetricFamily(prefix + "accepted_tokens", "Draft tokens the model accepted",
                                  value=counters.accepted_tokens)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
