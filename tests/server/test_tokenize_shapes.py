"""POST /tokenize takes vLLM's bodies beside TGI's (issue 59): `prompt` (vLLM's completion body) and `messages`
(vLLM's chat body) answer vLLM's {count, max_model_len, tokens, token_strs}; the chat body's ids are those the chat
route gives the engine (its usage counts them), its limits and errors the chat route's; TGI's `inputs` answers as
always."""

from __future__ import annotations

import pytest

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.server.app import create_app
from tests.helpers import asgi_calls

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name the capital of France."}]
TOOL = {"type": "function", "function": {"name": "capital", "description": "The capital of a country",
                                         "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def served(embedded):
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048, max_input_length=255,
                                                        max_total_tokens=256)))
    yield engine, create_app(engine, ServerConfig(max_messages=3))
    engine.shutdown()


def calls(served, *requests):
    return asgi_calls(served[1], *requests)


def test_prompt_body_is_the_tokenizers_encoding(served):
    engine, _ = served
    hf = engine.model.tokenizer.hf
    text = "The capital of France is Paris."
    plain, bare, strs = calls(served, ("POST", "/tokenize", {"prompt": text}),
                              ("POST", "/tokenize", {"model": engine.model.model_id, "prompt": text,
                                                     "add_special_tokens": False}),
                              ("POST", "/tokenize", {"prompt": text, "return_token_strs": True}))
    ids = hf.encode(text, add_special_tokens=True)
    assert plain.status_code == 200, plain.text
    assert plain.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    assert bare.json()["tokens"] == hf.encode(text, add_special_tokens=False)
    assert strs.json()["token_strs"] == hf.convert_ids_to_tokens(ids) and strs.json()["tokens"] == ids


def test_chat_body_ids_are_the_chat_routes_prompt(served):
    chat = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    answered, with_tools, opened, closed, tools, strs = calls(
        served, ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", {**chat, "tools": [TOOL]}),
        ("POST", "/tokenize", {"messages": MESSAGES}),
        ("POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}),
        ("POST", "/tokenize", {"messages": MESSAGES, "tools": [TOOL]}),
        ("POST", "/tokenize", {"messages": MESSAGES, "return_token_strs": True}))
    assert answered.status_code == 200 and with_tools.status_code == 200, (answered.text, with_tools.text)
    assert opened.status_code == 200, opened.text
    assert opened.json()["count"] == len(opened.json()["tokens"]) == answered.json()["usage"]["prompt_tokens"]
    assert opened.json()["max_model_len"] == 256 and opened.json()["token_strs"] is None
    assert tools.json()["count"] == with_tools.json()["usage"]["prompt_tokens"] > opened.json()["count"]
    # Without the assistant's opening: fewer tokens, the same start.
    assert closed.status_code == 200 and closed.json()["count"] < opened.json()["count"]
    assert opened.json()["tokens"][: closed.json()["count"]] == closed.json()["tokens"]
    assert len(strs.json()["token_strs"]) == strs.json()["count"]


def test_continue_final_message_leaves_the_last_message_open(served):
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    opened, continued, both = calls(
        served, ("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False}),
        ("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}),
        ("POST", "/tokenize", {"messages": messages, "continue_final_message": True}))
    assert continued.status_code == 200, continued.text
    assert continued.json()["count"] < opened.json()["count"]  # no end-of-turn after the last message
    assert both.status_code == 422 and "continue_final_message" in both.json()["error"]


def test_tgi_body_answers_as_before(served):
    engine, _ = served
    text = "Hello world"
    (tokens,) = calls(served, ("POST", "/tokenize", {"inputs": text}))
    ids = engine.model.tokenizer.encode(text)
    assert tokens.status_code == 200
    assert [t["id"] for t in tokens.json()] == ids
    assert all(set(t) == {"id", "text", "start", "stop"} for t in tokens.json())
    assert text[tokens.json()[0]["start"]:tokens.json()[-1]["stop"]] == text


def test_unknown_model_and_mixed_or_unserved_bodies_are_refused_by_name(served):
    refused = calls(
        served,
        ("POST", "/tokenize", {"model": "no-such-model", "prompt": "hi"}),
        ("POST", "/tokenize", {"model": "no-such-model", "messages": MESSAGES}),
        ("POST", "/tokenize", {"inputs": "hi", "prompt": "hi"}),
        ("POST", "/tokenize", {"prompt": "hi", "messages": MESSAGES}),
        ("POST", "/tokenize", {"add_special_tokens": True}),
        ("POST", "/tokenize", {"prompt": "hi", "add_generation_prompt": False}),
        ("POST", "/tokenize", {"inputs": "hi", "return_token_strs": True}),
        ("POST", "/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}),
        ("POST", "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}),
        ("POST", "/tokenize", {"messages": MESSAGES, "mm_processor_kwargs": {"num_crops": 4}}),
        ("POST", "/tokenize", {"prompt": 3}),
        ("POST", "/tokenize", {"messages": []}),
    )
    (unknown, unknown_chat, mixed, mixed_vllm, neither, foreign, foreign_tgi, template, kwargs, mm, wrong, empty) = refused
    assert unknown.status_code == unknown_chat.status_code == 404
    assert unknown.json()["error_type"] == "not_found" and "no-such-model" in unknown.json()["error"]
    for response in refused[2:]:
        assert response.status_code == 422, response.text
        assert response.json()["error_type"] == "validation"  # the native shape, off /v1/
    assert "inputs and prompt" in mixed.json()["error"] and "prompt and messages" in mixed_vllm.json()["error"]
    assert "got none" in neither.json()["error"]
    assert foreign.json()["error"].startswith("add_generation_prompt is not a field of vLLM's completion body")
    assert foreign_tgi.json()["error"].startswith("return_token_strs is not a field of TGI's body")
    assert template.json()["error"].startswith("chat_template is not supported")
    assert kwargs.json()["error"].startswith("chat_template_kwargs is not supported")
    assert mm.json()["error"].startswith("mm_processor_kwargs is not supported")
    assert wrong.json()["error"].startswith("prompt: ")  # the field as the shape names it
    assert empty.json()["error"].startswith("messages: ")


def test_limits_are_the_chat_routes(served):
    """--max-messages, --max-input-length and a text-only model's image refusal: the chat route's messages, in the
    native shape (422)."""
    many = [{"role": "user", "content": f"question {i}"} for i in range(4)]
    long = [{"role": "user", "content": "Paris is the capital of France. " * 60}]
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]
    pairs = [(many, None), (long, None), (image, None), (MESSAGES, [TOOL] * 2)]
    requests = []
    for messages, tools in pairs:
        extra = {"tools": tools} if tools else {}
        requests += [("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra}),
                     ("POST", "/tokenize", {"messages": messages, **extra})]
    answers = calls(served, *requests)
    for (messages, tools), chat, tokenized in zip(pairs, answers[::2], answers[1::2]):
        if tools:  # duplicated tool names: refused alike
            assert chat.status_code == 400 and tokenized.status_code == 422
            assert tokenized.json()["error"] == chat.json()["error"]["message"]
            continue
        assert chat.status_code == 400, chat.text
        assert tokenized.status_code == 422, tokenized.text
        assert tokenized.json()["error"] == chat.json()["error"]["message"]
    assert "--max-messages" in answers[1].json()["error"] and "max input length" in answers[3].json()["error"]
    assert "does not take images" in answers[5].json()["error"]
