"""Prometheus metrics under LoRAX's names and vLLM's.

LoRAX's counters are exposed under their exact names (`lorax_request_count`, not `..._total`), typed as
counters, as LoRAX's Rust exporter writes them: dashboards built for LoRAX work unchanged. vLLM's request
series (histograms, counters and gauges) carry its `model_name` label, so dashboards and routers built for vLLM read
ours. Engine-state gauges are read at scrape time.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from loraplex.params import FinishReason
from loraplex.server import request_log

if TYPE_CHECKING:
    from loraplex.engine.requests.output import RequestOutput
    from loraplex.engine.stats import EngineStats
    from loraplex.server.admission import Admission

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# vLLM's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's `finished_reason` values.
FINISHED_REASONS = {FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.LENGTH: "length",
                    FinishReason.ABORTED: "abort"}
BASE_ADAPTER = "base"  # the `adapter` label of requests served by the base model
MAX_ADAPTER_LABELS = 100  # distinct `adapter` label values; later adapters are counted as "other"
OTHER_ADAPTERS = "other"
# lorax_request_failure's `err` label (LoRAX's label name; its values, as LoRAX's, lower_snake_case kinds:
# validation, overloaded, generation...) is named where the reason is known (Metrics.on_failure). A request
# refused or failed before any of those places (server/request_log.py counts it as it ends) is labelled by its
# status, with the kind its error body names.
STATUS_REASONS = {400: "validation", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                  405: "method_not_allowed", 408: "body_timeout", 409: "conflict", 413: "payload_too_large",
                  415: "unsupported_media_type", 422: "validation", 429: "overloaded", 500: "internal",
                  503: "unavailable", 504: "timed_out"}


class Metrics:
    def __init__(self, model_name: str, stats: "Callable[[], EngineStats]") -> None:
        """`stats`: the engine's snapshot, read at each scrape (AsyncEngine.stats)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # LoRAX's counters live apart: exposition() writes them as counters under their bare names.
        self.lorax_counters = CollectorRegistry(auto_describe=True)
        c = self.lorax_counters
        self.request_count = Gauge("lorax_request_count", "Requests received", ["adapter"], registry=c)
        self.request_success = Gauge("lorax_request_success", "Requests that finished", ["adapter"], registry=c)
        self.request_failure = Gauge("lorax_request_failure", "Requests that failed", ["err"], registry=c)
        c.register(_BatchInferenceCounters(stats))
        self.duration = Histogram("lorax_request_duration", "End-to-end seconds", buckets=DURATION_BUCKETS, registry=r)
        self.validation_duration = Histogram(
            "lorax_request_validation_duration", "Seconds from a request's arrival to its queueing (parsing, checks, "
            "tokenization, its adapter's load)", buckets=DURATION_BUCKETS, registry=r,
        )
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
        self.max_new_tokens = Histogram(
            "lorax_request_max_new_tokens", "max_new_tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.images = Counter("loraplex_images", "Images received in requests", registry=r)
        self.embedding_inputs = Counter("loraplex_embedding_inputs", "Inputs embedded (each one engine request)",
                                        ["route"], registry=r)
        self.embedding_tokens = Counter("loraplex_embedding_tokens", "Prompt tokens of the inputs embedded", ["route"],
                                        registry=r)
        self.adapter_admin = Counter("loraplex_adapter_admin", "Run-time adapter loads and unloads, by outcome",
                                     ["action", "result"], registry=r)
        self.image_processing = Histogram(
            "loraplex_image_processing_seconds", "Seconds the processor took per request's images (resize, tile)",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.vllm = _VllmRequestMetrics(r, model_name)
        self._adapter_labels: set[str] = {BASE_ADAPTER}
        r.register(_EngineGauges(stats, model_name))

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

    def on_request(self, num_prompt_tokens: int, adapter: str = BASE_ADAPTER, max_new_tokens: int | None = None) -> None:
        self.request_count.labels(self._label(adapter)).inc()
        self.input_length.observe(num_prompt_tokens)
        if max_new_tokens is not None:
            self.max_new_tokens.observe(max_new_tokens)
        if (record := request_log.current()) is not None:
            if not record.queued:  # its first engine request (of its n choices): validated now
                self.validation_duration.observe(time.perf_counter() - record.arrived)
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
        self.vllm.on_success(final)
        if (record := request_log.current()) is not None:
            record.finished_run(final)

    def on_embeddings(self, route: str, inputs: int, tokens: int) -> None:
        """An embedding request answered (/v1/embeddings or /embed): its inputs and their tokens, by route. Each
        input's engine request is counted with the others too (lorax_request_*, vllm:*), as generated tokens 0."""
        self.embedding_inputs.labels(route).inc(inputs)
        self.embedding_tokens.labels(route).inc(tokens)

    def on_images(self, count: int, seconds: float) -> None:
        self.images.inc(count)
        self.image_processing.observe(seconds)

    def watch_admission(self, admission: "Admission") -> None:
        """Expose the server's admitted load (server/admission.py) at scrape time."""
        self.registry.register(_AdmissionGauges(admission))

    def on_adapter_admin(self, action: str, result: str) -> None:
        """A run-time load or unload (server/adapter_admin.py): action load|unload, result loaded|replaced|
        unloaded|refused."""
        self.adapter_admin.labels(action, result).inc()

    def on_failure(self, kind: str) -> None:
        """A request refused or failed for the reason `kind` (the `err` label); the request's record notes it, so
        that it is not counted again as it ends."""
        self.request_failure.labels(kind).inc()
        record = request_log.current()
        if record is not None and record.counted_as is None:
            record.counted_as = kind

    def on_request_end(self, record: "request_log.RequestRecord") -> None:
        """A request's end (RequestLog, its outcome settled): one that did not end ok and that nothing counted (a
        refusal before any route: 401, 404, 405, 408, 413; a CORS layer's 400) is counted now, by its status."""
        if record.outcome == "ok" or record.counted_as is not None:
            return
        if record.outcome in ("refused", "failed"):
            kind = STATUS_REASONS.get(record.status) or ("refused" if 400 <= record.status < 500 else "internal")
        else:  # client_gone, timed_out, shutdown
            kind = record.outcome or "internal"
        record.counted_as = kind
        self.request_failure.labels(kind).inc()

    def exposition(self) -> bytes:
        # prometheus_client appends `_total` to a counter's name; LoRAX's have none, so they are kept as
        # gauges (same samples, same escaping) and only their TYPE line says counter.
        lorax = re.sub(rb"^(# TYPE \S+) gauge$", rb"\1 counter", generate_latest(self.lorax_counters), flags=re.M)
        return generate_latest(self.registry) + lorax


class _VllmRequestMetrics:
    """vLLM's per-request histograms and token counters, observed when a request finishes (a request aborted
    or failed mid-way is not counted), from the engine's timestamps."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        m, r = ["model_name"], registry
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (vLLM's older name for the inter-token "
                              "latency).", m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               m, buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=r)
        for reason in sorted(set(FINISHED_REASONS.values())):  # every series from the start, at 0, as vLLM
            self.success.labels(model_name, reason)

    def on_success(self, final: "RequestOutput") -> None:
        t = final.timings
        self.ttft.observe(t.get("first_token", 0.0))
        self.e2e.observe(t.get("total", 0.0))
        self.queue.observe(t.get("queue", 0.0))
        # One gap per engine step after the first token, as vLLM observes it, for streamed and whole answers
        # alike: the engine stamps each token (a step that accepts drafts makes several at once: one gap).
        times = final.token_times or []
        for earlier, later in zip(times, times[1:]):
            if later > earlier:
                self.itl.observe(later - earlier)
                self.tpot.observe(later - earlier)
        self.prompt_tokens.inc(final.num_prompt_tokens)
        self.generation_tokens.inc(final.num_generated_tokens)
        reason = FINISHED_REASONS.get(final.finish_reason, "stop")
        self.success.labels(self.model_name, reason).inc()


class _EngineGauges:
    """Scrape-time reads of the engine's queues, KV cache and counters, from its stats snapshot; vLLM's series with
    its `model_name` label."""

    def __init__(self, stats: "Callable[[], EngineStats]", model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats = self.stats()
        vllm = functools.partial(_vllm, self.model_name)
        yield _gauge("lorax_queue_length", "Requests waiting", stats.num_waiting)
        yield _gauge("lorax_batch_current_size", "Requests in the running batch", stats.num_running)
        yield _gauge("lorax_batch_current_max_tokens", "Prompt + max_new_tokens of the running requests",
                     stats.batch_max_tokens)
        yield from _step_histograms(stats.steps)
        yield vllm(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting", stats.num_waiting)
        yield vllm(GaugeMetricFamily, "vllm:num_requests_running", "Requests running", stats.num_running)
        yield vllm(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache usage, 0..1", stats.kv_cache_usage)
        if stats.state_cache_usage is not None:  # Mllama: image states in a pool of their own
            yield _gauge("loraplex_state_cache_usage_perc", "Image state cache usage, 0..1", stats.state_cache_usage)
        # vLLM's names, in tokens, so dashboards and routers that read a prefix-cache hit rate read ours.
        yield vllm(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                   stats.prefix_cache_queries)
        yield vllm(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                   stats.prefix_cache_hits)
        if stats.encoded_images is not None:
            yield CounterMetricFamily("loraplex_vision_encoded_images", "Images run through the vision tower",
                                      value=stats.encoded_images)
            yield CounterMetricFamily("loraplex_vision_encoder_seconds", "Seconds spent in the vision tower and projector",
                                      value=stats.vision_encoder_seconds)
        yield vllm(CounterMetricFamily, "vllm:num_preemptions", "Requests preempted (KV cache full), recomputed later",
                   stats.num_preemptions)
        yield from _spec_decode_counters(stats, vllm)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Adapters of running and waiting requests",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([self.model_name, ",".join(stats.running_adapters), ",".join(stats.waiting_adapters),
                         str(stats.max_adapters)], time.time())
        yield info

    def describe(self):
        return []


class _BatchInferenceCounters:
    """LoRAX's per-step counters by `method` (prefill|decode), from the stats snapshot; kept as gauges in the LoRAX
    counters' registry, so that `Metrics.exposition` writes them as counters under their bare names."""

    def __init__(self, stats: "Callable[[], EngineStats]") -> None:
        self.stats = stats

    def collect(self):
        steps = self.stats().steps
        for name, doc, counts in (("lorax_batch_inference_count", "Engine steps run", steps.count),
                                  ("lorax_batch_inference_success", "Engine steps that succeeded", steps.success),
                                  ("lorax_batch_inference_failure", "Engine steps that failed", steps.failure)):
            family = GaugeMetricFamily(name, doc, labels=["method"])
            for method, value in counts.items():
                family.add_metric([method], value)
            yield family

    def describe(self):
        return []


class _AdmissionGauges:
    """Requests admitted and not finished, and their queued tokens (what the admission limits count)."""

    def __init__(self, admission: "Admission") -> None:
        self.admission = admission

    def collect(self):
        yield _gauge("loraplex_requests_in_flight", "Requests admitted and not finished (--max-concurrent-requests)",
                     self.admission.in_flight)
        yield _gauge("loraplex_queued_tokens", "Prompt + max_new_tokens of the requests in flight (--max-queued-tokens)",
                     self.admission.queued_tokens)

    def describe(self):
        return []


def _spec_decode_counters(stats: "EngineStats", vllm):
    """Speculative decoding's drafted and accepted tokens, under loraplex's names and vLLM's (`_total` added)."""
    yield CounterMetricFamily("loraplex_spec_decode_draft_tokens", "Draft tokens the model verified",
                              value=stats.spec_draft_tokens)
    yield CounterMetricFamily("loraplex_spec_decode_accepted_tokens", "Draft tokens the model accepted",
                              value=stats.spec_accepted_tokens)
    yield vllm(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens the model verified",
               stats.spec_draft_tokens)
    yield vllm(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Draft tokens the model accepted",
               stats.spec_accepted_tokens)


def _step_histograms(steps):
    """LoRAX's batch histograms from the step recorder's snapshot (engine/step_metrics.py): the requests each step
    started (steps that started any), and successful steps' seconds by `method`."""
    next_size = HistogramMetricFamily("lorax_batch_next_size", "Requests started by a step (steps that start any)")
    next_size.add_metric([], _buckets(steps.next_size), steps.next_size.sum)
    yield next_size
    duration = HistogramMetricFamily("lorax_batch_inference_duration", "Seconds per successful engine step",
                                     labels=["method"])
    for method, histogram in steps.duration.items():
        duration.add_metric([method], _buckets(histogram), histogram.sum)
    yield duration


def _buckets(histogram) -> list[tuple[str, int]]:
    return [(floatToGoString(bound), count) for bound, count in histogram.cumulative()]


def _vllm(model_name: str, family, name: str, doc: str, value: float):
    """A vLLM series, labelled with the served model's name as vLLM labels its own."""
    metric = family(name, doc, labels=["model_name"])
    metric.add_metric([model_name], value)
    return metric


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
