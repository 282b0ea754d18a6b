"""Private hub adapters over HTTP, through both APIs: `api_token` reaches the store on /generate,
/generate_stream, merged adapters and the OpenAI routes; a request without the token (or with another) gets
404 as for a missing adapter, naming the id it gave, though a token holder's request loaded the adapter; the
token is in no response, log line, metric or /v1/models entry. The in-process app, its store given a fake hub
(tests/lora/fake_hub.py) serving a shipped adapter as a private repo."""

from __future__ import annotations

import logging
import pathlib

import pytest

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.lora.sources.hub_source import token_scope
from loraplex.lora.sources.store import AdapterStore
from loraplex.server.app import create_app
from tests.helpers import asgi_calls
from tests.lora.fake_hub import FakeHub

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
TOKEN = "hf_secretTokenOfTheOwner0123456789"
OTHER = "hf_someoneElsesToken9876543210abc"
CHAT = "/v1/chat/completions"


@pytest.fixture
def app(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    app = create_app(engine, ServerConfig(adapter_source="hub"))
    hub = FakeHub()
    hub.publish("org/private", SHIPPED / "name-nova", TOKEN)
    hub.publish("org/public", SHIPPED / "name-lyra")
    state = app.state.loraplex
    state.adapters.close()
    targets = engine.model.adapter_targets
    state.adapters = AdapterStore(targets.base_shapes, targets.max_rank,
                                  default_source="hub", hub=hub)
    yield app
    state.adapters.close()
    engine.shutdown()




def native(token: str | None = None, **parameters) -> dict:
    parameters = {"max_new_tokens": 2, "ignore_eos_token": True, **parameters}
    return {"inputs": "Hello", "parameters": {**parameters, **({"api_token": token} if token else {})}}


def chat(model: str, token: str | None = None, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    return {**body, **({"api_token": token} if token else {})}


def no_token_in(text: str) -> None:
    for secret in (TOKEN, OTHER, token_scope(TOKEN), token_scope(OTHER)):
        assert secret not in text


def test_both_apis_check_the_token_on_every_request(app, caplog):
    caplog.set_level(logging.DEBUG)
    merged = {"ids": ["org/private", "org/public"], "weights": [0.5, 0.5]}
    completion = {"model": "", "prompt": "Hi", "max_tokens": 2, "adapter_id": "org/private"}
    calls = [
        ("POST", "/generate", native(TOKEN, adapter_id="org/private")),  # loads it
        ("POST", "/generate", native(adapter_id="org/private")),
        ("POST", "/generate", native(OTHER, adapter_id="org/private")),
        ("POST", "/generate_stream", native(adapter_id="org/private")),
        ("POST", "/generate", native(merged_adapters=merged)),
        ("POST", CHAT, chat("org/private")),
        ("POST", "/v1/completions", {**completion, "api_token": OTHER}),
        ("POST", CHAT, chat("org/private", TOKEN)),
        ("POST", "/generate_stream", native(TOKEN, adapter_id="org/private")),
        ("POST", "/generate", native(TOKEN, merged_adapters=merged)),
        ("POST", "/generate", native(adapter_id="org/public")),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
    ]
    responses = asgi_calls(app, *calls)
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 404, 404, 404, 404, 404, 404, 200, 200, 200, 200, 200, 200], [r.text for r in responses]
    for refused in responses[1:5]:  # native: as a missing adapter, by the id the client gave
        assert refused.json()["error_type"] == "not_found"
        assert refused.json()["error"].startswith("adapter 'org/private' not found")
    for refused in responses[5:7]:  # OpenAI: the same, in its shape
        assert refused.json()["error"]["code"] == "model_not_found"
        assert refused.json()["error"]["message"].startswith("adapter 'org/private' not found")
    assert responses[0].headers["x-adapter-id"] == responses[7].headers["x-adapter-id"] == "org/private"
    models = [m["id"] for m in responses[11].json()["data"]]
    assert "org/public" in models and "org/private" not in models  # one token's adapter is no one else's to see
    metrics = responses[12].text
    assert 'adapter="org/private"' in metrics  # labelled by the id
    for response in responses:
        no_token_in(response.text)
        no_token_in(str(response.headers))
    no_token_in("\n".join(record.getMessage() for record in caplog.records))


def test_a_hub_that_cannot_be_reached_is_a_503_in_both_apis(app):
    from loraplex.lora.errors import AdapterSourceUnavailable

    def unreachable(repo_id, revision, token):
        raise AdapterSourceUnavailable(f"adapter {repo_id!r}: the Hugging Face Hub cannot be reached from this server")

    app.state.loraplex.adapters.hub.resolve = unreachable
    native_answer, openai_answer = asgi_calls(app, ("POST", "/generate", native(adapter_id="org/public")),
                                              ("POST", CHAT, chat("org/public")))
    assert native_answer.status_code == 503 and native_answer.json()["error_type"] == "unavailable"
    assert "cannot be reached" in native_answer.json()["error"]
    assert openai_answer.status_code == 503 and openai_answer.json()["error"]["code"] == "adapter_source_unavailable"
