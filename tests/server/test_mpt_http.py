"""A tiny MPT checkpoint served over both APIs (in process): completions and /generate serve; chat is a
400 that says why while the checkpoint has no chat template, and served once one is given."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel
from loraplex.server.app import create_app
from loraplex.tokenizer import Tokenizer
from tests.helpers import load_ours, tiny_mpt


@pytest.fixture(scope="module")
def served(embedded, tmp_path_factory):
    ours, config = load_ours(tiny_mpt(), tmp_path_factory.mktemp("mpt"))
    hf_tokenizer = embedded.tokenizer.hf
    template, hf_tokenizer.chat_template = hf_tokenizer.chat_template, None  # as MPT checkpoints ship
    tokenizer = Tokenizer(hf_tokenizer)
    loaded = LoadedModel(ours, config, tokenizer, torch.device("cpu"), torch.float32, "tiny-mpt")
    engine = AsyncEngine(Engine(loaded, EngineConfig(device="cpu", max_batch_total_tokens=1024)))
    try:
        yield create_app(engine), hf_tokenizer, template
    finally:
        hf_tokenizer.chat_template = template
        engine.shutdown()


def call(app, *requests):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))

    return asyncio.run(main())


def test_completions_and_generate_serve_and_chat_says_why_it_cannot(served):
    app, hf_tokenizer, template = served
    chat_body = {"model": "", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    completion, native, chat = call(
        app,
        ("/v1/completions", {"model": "", "prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}),
        ("/generate", {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4, "details": True}}),
        ("/v1/chat/completions", chat_body),
    )
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
    assert native.status_code == 200 and len(native.json()["details"]["tokens"]) == 4
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    hf_tokenizer.chat_template = template  # e.g. from --chat-template FILE
    try:
        (chat,) = call(app, ("/v1/chat/completions", chat_body))
    finally:
        hf_tokenizer.chat_template = None
    assert chat.status_code == 200, chat.text


def test_a_chat_template_file_is_used(tmp_path):
    from loraplex.engine.loading import load_model

    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    loaded = load_model(EngineConfig(device="cpu", chat_template=str(path)), log=lambda _: None)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
