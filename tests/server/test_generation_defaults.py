"""generation_config.json's sampling values: the OpenAI routes' defaults where a request sets none (vLLM's
`--generation-config auto`), never the native API's (LoRAX's), and none with `--generation-config ignore`."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.loading import with_generation_config
from loraplex.protocol.openai import CompletionRequest, checked_sampling_defaults
from loraplex.server.app import create_app

PROMPT = "Once upon a time, there was a little"


def test_generation_config_sampling_values_are_read_as_numbers(embedded):
    generation = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "min_p": "0.1",
                  "repetition_penalty": True, "bos_token_id": 1}
    config = with_generation_config(embedded.config, generation)
    assert config.sampling_defaults == (("temperature", 0.6), ("top_p", 0.9), ("top_k", 20))
    assert with_generation_config(embedded.config, {"bos_token_id": 1}) == embedded.config


def test_out_of_range_defaults_are_refused_by_name():
    accepted, refused = checked_sampling_defaults((("temperature", 5.0), ("top_p", 0.8), ("top_k", -3)))
    assert accepted == {"top_p": 0.8}
    assert len(refused) == 2 and "temperature 5.0" in refused[0] and "top_k -3" in refused[1]


def test_a_request_keeps_what_it_sets_and_takes_the_rest():
    request = CompletionRequest(prompt="x", temperature=0.3)
    params = request.with_defaults({"temperature": 0.6, "top_p": 0.9, "top_k": 20}).to_sampling_params(4)
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.9, 20)
    assert CompletionRequest(prompt="x").with_defaults({}).to_sampling_params(4).temperature == 1.0


def served_texts(embedded, generation_config: str) -> tuple[str, str]:
    """(an OpenAI completion's text, the native API's), both greedy, from a model whose generation config sets a
    strong repetition penalty."""
    from fastapi.testclient import TestClient

    penalised = dataclasses.replace(
        embedded, config=dataclasses.replace(embedded.config, sampling_defaults=(("repetition_penalty", 3.0),)))
    engine = Engine(penalised, EngineConfig(device="cpu", max_batch_total_tokens=2048))
    app = create_app(AsyncEngine(engine), ServerConfig(generation_config=generation_config))
    with TestClient(app) as http:
        openai = http.post("/v1/completions", json={"model": "", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                    "ignore_eos": True})
        native = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 24}})
    assert openai.status_code == native.status_code == 200, (openai.text, native.text)
    return openai.json()["choices"][0]["text"], native.json()["generated_text"]


@pytest.fixture(scope="module")
def unpenalised(embedded) -> tuple[str, str]:
    return served_texts(embedded, "ignore")


def test_openai_routes_take_the_defaults_and_the_native_api_does_not(embedded, unpenalised, caplog):
    plain_openai, plain_native = unpenalised
    assert plain_openai == plain_native  # both greedy, no penalty: the same tokens
    with caplog.at_level("INFO", logger="loraplex.server"):
        penalised_openai, penalised_native = served_texts(embedded, "auto")
    assert penalised_native == plain_native
    assert penalised_openai != plain_openai, "the generation config's repetition penalty changed nothing"
    assert any("repetition_penalty=3.0" in r.getMessage() for r in caplog.records)
