"""OpenAI's logit_bias and vLLM's min_tokens, bad_words and allowed_token_ids over HTTP, through the `openai` client
(the vLLM fields as its `extra_body`), and their refusals naming the field (issue 59)."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(max_logit_bias=4))) as client:
        yield client


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0)


def answer(client, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    reply = client.chat.completions.create(model="", messages=QUESTION, temperature=0, **kwargs)
    return reply.choices[0].message.content, reply.usage.completion_tokens


def test_logit_bias_moves_greedy_tokens(client, http):
    tokenizer = http.app.state.loraplex.tokenizer
    plain, _ = answer(client)
    assert "Paris" in plain
    paris = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    steered, _ = answer(client, logit_bias={str(paris): -100})
    assert "Paris" not in steered
    forced = tokenizer.encode("Hello", add_special_tokens=False)[0]
    pushed, _ = answer(client, logit_bias={str(forced): 100}, max_tokens=3)
    assert pushed.startswith("Hello")


def test_vllm_extras_through_extra_body(client, http):
    tokenizer = http.app.state.loraplex.tokenizer
    banned, _ = answer(client, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned
    plain, plain_tokens = answer(client)
    held, held_tokens = answer(client, max_tokens=16, extra_body={"min_tokens": plain_tokens + 3})
    assert held_tokens >= plain_tokens + 3 > plain_tokens
    allowed = sorted({*tokenizer.encode(" yes no", add_special_tokens=False), *tokenizer.eos_token_ids})
    only, _ = answer(client, max_tokens=4, extra_body={"allowed_token_ids": allowed})
    assert set(tokenizer.encode(only, add_special_tokens=False)) <= set(allowed)


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(5)}}, "logit_bias"),  # over --max-logit-bias 4
    ({"min_tokens": 20}, "min_tokens"),  # over max_tokens
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
])
def test_refused_fields_name_themselves(http, body, param):
    response = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8, **body})
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"].get("param") or "") + response.json()["error"]["message"]
