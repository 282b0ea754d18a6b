"""/metrics of the in-process app, read with prometheus_client's own parser: every family has its type,
LoRAX's counters are counters under their bare names, vLLM's request histograms and counters move with a
request, and the `adapter` label is the adapter as the client named it."""

from __future__ import annotations

import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.server import metrics as metrics_module
from loraplex.server.app import create_app
from loraplex.server.metrics import Metrics
from tests.helpers import asgi_calls

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
LORAX_COUNTERS = ("lorax_request_count", "lorax_request_success", "lorax_request_failure")
VLLM_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
)
VLLM_COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def make_app(make_engine):
    engines = []

    def make(**config):
        engines.append(AsyncEngine(make_engine(max_batch_total_tokens=2048)))
        return create_app(engines[-1], ServerConfig(**config))

    yield make
    for engine in engines:
        engine.shutdown()




def scrape(app) -> tuple[str, dict]:
    (response,) = asgi_calls(app, ("GET", "/metrics", None))
    return response.text, {f.name: f for f in text_string_to_metric_families(response.text)}


def total(families: dict, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in families[family].samples if s.name == sample and labels.items() <= s.labels.items())


def generate(max_new_tokens: int, **parameters) -> dict:
    return {"inputs": "Hello there", "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True,
                                                     **parameters}}


def test_every_family_parses_with_its_type_and_lorax_counters_keep_their_names(make_app):
    app = make_app()
    invalid = {"inputs": "x", "parameters": {"top_p": 2}}
    ok, bad = asgi_calls(app, ("POST", "/generate", generate(2)), ("POST", "/generate", invalid))
    assert (ok.status_code, bad.status_code) == (200, 422)
    text, families = scrape(app)
    untyped = [name for name, f in families.items() if f.type in ("unknown", "untyped")]
    assert not untyped, untyped  # a sample the parser could not tie to its family's TYPE line
    for name in LORAX_COUNTERS:
        assert families[name].type == "counter", name
        assert re.search(rf"^# TYPE {name} counter$", text, re.M), name
        assert re.search(rf"^{name}\{{", text, re.M) and f"{name}_total" not in text, name  # LoRAX's bare name
    for name in VLLM_HISTOGRAMS:
        assert families[name].type == "histogram", name
        assert {s.labels.get("model_name") for s in families[name].samples} == {MODEL}, name
    for name in VLLM_COUNTERS:
        assert families[name].type == "counter" and f"{name}_total{{" in text, name
    assert families["vllm:num_requests_running"].type == "gauge"
    assert families["lorax_request_duration"].type == "histogram"


def test_vllm_request_metrics_move_with_plain_and_streamed_requests(make_app):
    app = make_app()
    _, before = scrape(app)
    whole, streamed = asgi_calls(app, ("POST", "/generate", generate(5)), ("POST", "/generate_stream", generate(5)))
    assert whole.status_code == streamed.status_code == 200
    assert streamed.text.count("data:") == 5
    _, after = scrape(app)

    def moved(family: str, sample: str, **labels) -> float:
        return total(after, family, sample, **labels) - total(before, family, sample, **labels)

    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert moved(name, name + "_count") == 2, name
    # 5 tokens, one per step (no speculative decoding): 4 gaps each.
    assert moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 8
    assert moved("vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == 8
    ttft = moved("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum")
    e2e = moved("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    itl = moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_sum")
    assert 0 < ttft <= e2e and 0 < itl <= e2e - ttft + 1e-9
    prompt = int(whole.headers["x-prompt-tokens"])
    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name=MODEL) == 2 * prompt
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total", model_name=MODEL) == 10
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert moved("lorax_request_success", "lorax_request_success_total", adapter="base") == 2


def test_adapter_label_is_the_id_the_client_named(make_app):
    # Local adapters asked for by a request whose source is not the server's default: the store keys them
    # "local:<id>"; the label must stay the id the client sent.
    app = make_app(adapter_source="hub", adapter_roots=(str(ADAPTERS),))
    merged = {"ids": ["name-nova", "name-lyra"], "weights": [0.5, 0.5]}
    responses = asgi_calls(
        app,
        ("POST", "/generate", generate(2, adapter_id="name-nova", adapter_source="local")),
        ("POST", "/generate", generate(2, merged_adapters=merged, adapter_source="local")),
    )
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    text, families = scrape(app)
    labels = {s.labels["adapter"] for s in families["lorax_request_count"].samples}
    assert labels == {"name-nova", "name-nova,name-lyra"}, labels
    assert "local:" not in text and "merged-" not in text


def test_adapter_labels_stay_bounded(make_engine, monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_ADAPTER_LABELS", 3)  # "base" and two adapters
    engine = make_engine()
    metrics = Metrics(engine.model_id, engine.stats)
    for adapter in ("a", "b", "c", "d", "a"):
        metrics.on_request(1, adapter)
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    counts = {s.labels["adapter"]: s.value for s in families["lorax_request_count"].samples}
    assert counts == {"a": 2, "b": 1, "other": 2}
