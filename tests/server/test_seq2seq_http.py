"""Encoder-decoder checkpoints (tiny T5 and BART saved with real tokenizers) served over both APIs, loaded
the way `loraplex serve --model-id DIR` loads them: /generate (plain, streamed, details), POST /,
/v1/completions give transformers' greedy text; chat is a 400 that says why while there is no chat
template; /info names the model type; inputs over --max-input-length are refused, not truncated."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.loading import load_model
from loraplex.server.app import create_app
from tests.helpers import hf_seq2seq_greedy, tiny_seq2seq_tokenizer, tiny_t5

PROMPT = "translate English to German: the quick brown dog"
NEW = 8


def build(kind: str):
    tokenizer = tiny_seq2seq_tokenizer(kind)
    if kind == "t5":
        return tiny_t5(gated=True, seed=11, vocab_size=len(tokenizer)), tokenizer
    from tests.models.test_bart_parity import tiny_bart

    return tiny_bart(seed=11, vocab_size=len(tokenizer)), tokenizer


@pytest.fixture(scope="module", params=["t5", "bart"])
def served(request, tmp_path_factory):
    hf, tokenizer = build(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)  # what the server reads (ids may differ from the trained one's)
    config = EngineConfig(model_id=str(path), device="cpu", max_batch_total_tokens=1024, max_input_length=64)
    engine = AsyncEngine(Engine(load_model(config, log=lambda _: None), config))
    ids = tokenizer(PROMPT).input_ids
    want = tokenizer.decode(hf_seq2seq_greedy(hf, ids, NEW), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    try:
        yield request.param, create_app(engine), want, len(ids)
    finally:
        engine.shutdown()


def call(app, *requests):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))

    return asyncio.run(main())


def stream_events(app, path, body) -> list[dict]:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            response = await c.post(path, json=body)
            assert response.status_code == 200, response.text
            return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:") and "[DONE]" not in line]

    return asyncio.run(main())


def test_generate_and_completions_give_transformers_text(served):
    kind, app, want, num_input = served
    assert want.strip(), "the tiny model decodes to nothing: the test would prove little"
    parameters = {"max_new_tokens": NEW, "details": True, "decoder_input_details": True}
    native, root, completion = call(
        app,
        ("/generate", {"inputs": PROMPT, "parameters": parameters}),
        ("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW}}),
        ("/v1/completions", {"model": "", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}),
    )
    assert native.status_code == 200, native.text
    body = native.json()
    assert body["generated_text"] == want
    details = body["details"]
    assert details["prompt_tokens"] == num_input and details["prefill"] == []
    assert "not defined" in details["prefill_note"]
    assert root.status_code == 200 and root.json()[0]["generated_text"] == want
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == want
    assert completion.json()["usage"]["prompt_tokens"] == num_input


def test_streams_give_the_same_text(served):
    _, app, want, _ = served
    events = stream_events(app, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW}})
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == want
    assert events[-1]["generated_text"] == want
    chunks = stream_events(app, "/v1/completions", {"model": "", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want


def test_stop_sequence_cuts_the_text(served):
    _, app, want, _ = served
    stop = want.strip()[2:5]
    (native,) = call(app, ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "stop": [stop]}}))
    assert native.status_code == 200 and native.json()["generated_text"] == want[: want.index(stop)]  # stop cut off


def test_chat_says_why_it_cannot_and_info_names_the_type(served):
    kind, app, _, _ = served
    (chat,) = call(app, ("/v1/chat/completions", {"model": "", "messages": [{"role": "user", "content": "hi"}]}))
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]

    async def info():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return (await c.get("/info")).json()

    body = asyncio.run(info())
    assert body["model_type"] == kind and body["is_encoder_decoder"] is True


def test_prompt_logprobs_are_refused_not_invented(served):
    _, app, want, _ = served
    refused, echoed = call(
        app,
        ("/v1/completions", {"model": "", "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1}),
        ("/v1/completions", {"model": "", "prompt": PROMPT, "max_tokens": NEW, "echo": True, "temperature": 0}),
    )
    assert refused.status_code == 400 and "encoder-decoder" in refused.json()["error"]["message"]
    assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"] == PROMPT + want


def test_long_inputs_are_refused_not_truncated(served):
    _, app, _, _ = served
    long = " ".join(["the quick brown dog"] * 40)
    native, completion = call(
        app,
        ("/generate", {"inputs": long, "parameters": {"max_new_tokens": 2}}),
        ("/v1/completions", {"model": "", "prompt": long, "max_tokens": 2}),
    )
    assert native.status_code == 422 and "max input length" in native.json()["error"]
    assert completion.status_code == 400 and "max input length" in completion.json()["error"]["message"]


def test_chat_with_a_template_serves_the_templated_prompt(tmp_path):
    """With a chat template (here from --chat-template FILE), chat turns the messages into the encoder's
    input: the answer is transformers' greedy text for that prompt."""
    hf, tokenizer = build("t5")
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}")
    config = EngineConfig(model_id=str(tmp_path), device="cpu", max_batch_total_tokens=1024, chat_template=str(template))
    engine = AsyncEngine(Engine(load_model(config, log=lambda _: None), config))
    try:
        (chat,) = call(create_app(engine), ("/v1/chat/completions", {
            "model": "", "messages": [{"role": "user", "content": "the quick brown dog"}], "max_tokens": NEW, "temperature": 0,
        }))
    finally:
        engine.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("user: the quick brown dog ", add_special_tokens=False).input_ids
    want = tokenizer.decode(hf_seq2seq_greedy(hf, ids, NEW), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == want


def test_embeddings_pool_the_encoders_output(served):
    """/v1/embeddings and /embed on T5 and BART: the mean of the encoder's output, normalised (sentence-T5's)."""
    kind, app, _, num_input = served
    openai_answer, lorax_answer = call(app, ("/v1/embeddings", {"input": PROMPT}), ("/embed", {"inputs": PROMPT}))
    assert openai_answer.status_code == 200 and lorax_answer.status_code == 200, (openai_answer.text, lorax_answer.text)
    vector = openai_answer.json()["data"][0]["embedding"]
    assert openai_answer.json()["usage"]["prompt_tokens"] == num_input
    assert abs(sum(v * v for v in vector) - 1.0) < 1e-4 and lorax_answer.json()["embeddings"] == vector
