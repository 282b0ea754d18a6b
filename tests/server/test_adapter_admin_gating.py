"""Run-time adapter management is off unless asked for, needs the API key when one is set, and frees an unloaded
adapter's device slot once its requests are done (issue 56)."""

from __future__ import annotations

import pathlib

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.lora.adapter import load_adapter_dir
from loraplex.params import SamplingParams
from loraplex.server.app import create_app
from tests.helpers import asgi_calls

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
LOAD = {"lora_name": "nova", "lora_path": "name-nova"}


def app_with(make_engine, **config):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    return create_app(engine, ServerConfig(adapter_source="local", adapter_roots=(str(ROOT),), **config)), engine


def test_off_by_default_with_a_clear_404(make_engine):
    app, engine = app_with(make_engine)
    try:
        load, unload = asgi_calls(app, ("POST", "/v1/load_lora_adapter", LOAD),
                                  ("POST", "/unload_lora_adapter", {"lora_name": "nova"}))
    finally:
        engine.shutdown()
    for response in (load, unload):
        assert response.status_code == 404, response.text
        assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]


def test_the_api_key_is_required(make_engine):
    app, engine = app_with(make_engine, allow_runtime_lora_updating=True, api_keys=("secret",))
    try:
        refused, = asgi_calls(app, ("POST", "/v1/load_lora_adapter", LOAD))
        assert refused.status_code == 401, refused.text
        assert "nova" not in app.state.loraplex.adapters.named
    finally:
        engine.shutdown()


def test_a_retired_adapters_slot_is_freed_once_its_requests_end(make_engine):
    engine = make_engine(max_active_adapters=2)
    adapter = load_adapter_dir(ROOT / "name-nova", "nova", engine.adapter_targets().base_shapes, 64)
    request = engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=4, ignore_eos=True), adapter=adapter)
    engine.step()
    slots = engine.scheduler.slots
    assert slots.slot_of(adapter.key) is not None and request.adapter_slot is not None
    engine.retire_adapter(adapter.key)
    assert slots.slot_of(adapter.key) is not None  # its request still runs on it
    while engine.has_unfinished:
        engine.step()
    engine.step()  # the next step starts by freeing it
    assert slots.slot_of(adapter.key) is None and not engine.adapters.retired


def test_served_model_names_name_the_base_everywhere(make_engine):
    app, engine = app_with(make_engine, served_model_name=("house-model", "alias"))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        models, by_alias, by_id = asgi_calls(
            app, ("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {**chat, "model": "alias"}),
            ("POST", "/v1/chat/completions", {**chat, "model": engine.model.model_id}))
    finally:
        engine.shutdown()
    cards = models.json()["data"]
    assert [c["id"] for c in cards[:2]] == ["house-model", "alias"] and all(c["parent"] is None for c in cards[:2])
    assert engine.model.model_id not in {c["id"] for c in cards}
    for answer in (by_alias, by_id):
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "house-model" and "x-adapter-id" not in answer.headers


def test_the_default_adapter_serves_requests_that_name_none(make_engine):
    app, engine = app_with(make_engine, default_adapter_id="name-nova")
    generate = {"inputs": "What is your name?", "parameters": {"max_new_tokens": 2}}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        info, native, named, openai_default, openai_base = asgi_calls(
            app, ("GET", "/info", None), ("POST", "/generate", generate),
            ("POST", "/generate", {**generate, "parameters": {"max_new_tokens": 2, "adapter_id": "name-lyra"}}),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/v1/chat/completions", {**chat, "model": engine.model.model_id}))
    finally:
        engine.shutdown()
    assert native.headers["x-adapter-id"] == "name-nova" and named.headers["x-adapter-id"] == "name-lyra"
    assert info.json()["default_adapter_id"] == "name-nova" and "name-nova" in info.json()["adapters"]
    assert openai_default.headers["x-adapter-id"] == "name-nova"
    assert "x-adapter-id" not in openai_base.headers  # naming the base model reaches the base


def test_a_run_time_load_gives_pefts_greedy_tokens(make_engine, embedded_hf):
    from tests.lora.peft_helpers import peft_from_dir, reference_greedy

    app, engine = app_with(make_engine, allow_runtime_lora_updating=True)
    prompt = "<|im_start|>user\nWhat is your name?<|im_end|>\n<|im_start|>assistant\n"
    generate = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True, "adapter_id": "nova"}}
    try:
        loaded, answer = asgi_calls(app, ("POST", "/v1/load_lora_adapter", LOAD), ("POST", "/generate", generate))
        prompt_ids = engine.model.tokenizer.encode(prompt, add_special_tokens=True)
    finally:
        engine.shutdown()
    assert loaded.status_code == 200 and answer.status_code == 200, (loaded.text, answer.text)
    tokens = [t["id"] for t in answer.json()["details"]["tokens"]]
    expected = reference_greedy(peft_from_dir(embedded_hf, ROOT / "name-nova"), prompt_ids, 12)  # EOS no stop
    finish = answer.json()["details"]["finish_reason"]
    assert tokens == expected[: len(tokens)] and (len(tokens) == 12 or finish == "eos_token"), (tokens, expected)
    assert expected != reference_greedy(embedded_hf, prompt_ids, 12), "the adapter changes nothing"


def test_pinning_is_refused_past_all_but_one_slot(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048, max_active_adapters=3))
    app = create_app(engine, ServerConfig(adapter_source="local", adapter_roots=(str(ROOT),),
                                          allow_runtime_lora_updating=True))
    load = lambda name, path: ("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,  # noqa: E731
                                                                  "pinned": True})
    try:
        # The engine applies commands in order: once the last request is answered, the holds before it are in.
        first, second, third, _ = asgi_calls(app, load("a", "name-nova"), load("b", "name-lyra"),
                                             load("c", "name-orion"),
                                             ("POST", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}))
        assert engine.engine.scheduler.slots.held == {app.state.loraplex.adapters.load(n).key for n in ("a", "b")}
    finally:
        engine.shutdown()
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert third.status_code == 400 and third.json()["error"]["code"] == "too_many_pinned", third.text
