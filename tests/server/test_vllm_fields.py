"""vLLM's fields on /v1/completions and /v1/chat/completions that used to be accepted and ignored (issue 59):
prompt_logprobs, include_stop_str_in_output, truncate_prompt_tokens, spaces_between_special_tokens, OpenAI's
suffix (fill in the middle, where the tokenizer has its tokens), and the fields this server recognises but does not
serve: each a 400 naming it. Fields no API defines stay ignored, named in one debug log line."""

from __future__ import annotations

import json
import logging
import threading

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server import openai_inputs
from loraplex.server.app import create_app

PROMPT = "The capital of France is Paris, and the capital of Italy is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    with TestClient(create_app(AsyncEngine(engine))) as client:
        yield client


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(http):
    return http.app.state.loraplex.tokenizer


def complete(http, **body) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(http, route: str, body: dict) -> dict:
    base = {"prompt": PROMPT} if route == "completions" else {"messages": QUESTION}
    response = http.post(f"/v1/{route}", json={**base, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def reference_logprobs(embedded_hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the prompt, float32: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(embedded_hf(torch.tensor([ids])).logits[0].float(), -1)


def check_prompt_logprobs(entries: list, ids: list[int], reference: torch.Tensor, tokenizer, top: int = 0) -> None:
    """Each prompt token's entry (the first has none): its own logprob and rank, and the `top` likeliest tokens with
    ranks 1..top, all as transformers' log-softmax over the prompt gives them."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row = reference[i - 1]
        tokens = [int(t) for t in entries[i]]
        own_is_among_top = entries[i][str(ids[i])]["rank"] <= top  # then one entry is both
        assert tokens[0] == ids[i] and len(set(tokens[1:])) == len(tokens) - 1 == top - own_is_among_top, (i, tokens)
        kth = row.topk(top).values[-1].item() if top else None
        for token, entry in zip(tokens, entries[i].values()):
            value = row[token].item()
            assert abs(entry["logprob"] - value) < 1e-4, (i, entry)
            assert entry["decoded_token"] == tokenizer.token_text(token)
            # vLLM's rank: how many tokens are at least as likely (bounds: near-ties may order either way)
            assert int((row > value + 1e-4).sum()) + 1 <= entry["rank"] <= int((row >= value - 1e-4).sum()), (i, entry)
            if token != ids[i]:  # an alternative: among the `top` likeliest
                assert entry["rank"] <= top and value >= kth - 1e-4, (i, token, entry)


# ---- prompt_logprobs -----------------------------------------------------------------------------


def test_prompt_logprobs_match_transformers_beside_a_plain_request(http, tokenizer, embedded_hf):
    ids = tokenizer.encode(PROMPT)
    alone = complete(http, prompt="Once upon a time", max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    plain: dict = {}

    def run_plain():  # decoding while the other request's prompt is scored: one batch
        plain.update(complete(http, prompt="Once upon a time", max_tokens=24, ignore_eos=True))

    thread = threading.Thread(target=run_plain)
    thread.start()
    answer = complete(http, prompt_logprobs=0, n=2, temperature=0.7, seed=1)
    thread.join()
    reference = reference_logprobs(embedded_hf, ids)
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:  # vLLM's place: on each completion choice
        check_prompt_logprobs(choice["prompt_logprobs"], ids, reference, tokenizer)
    assert "prompt_logprobs" not in plain["choices"][0] and plain["choices"][0]["text"] == alone
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_chat_prompt_logprobs_beside_the_choices(http, tokenizer, embedded_hf):
    response = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 3, "prompt_logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    check_prompt_logprobs(body["prompt_logprobs"], ids, reference_logprobs(embedded_hf, ids), tokenizer)
    plain = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


def test_prompt_logprobs_with_alternatives_on_both_routes(http, tokenizer, embedded_hf):
    """vLLM's prompt_logprobs: k: each prompt position's k likeliest tokens beside the prompt's own."""
    ids = tokenizer.encode(PROMPT)
    answer = complete(http, prompt_logprobs=3, max_tokens=2)
    check_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], ids, reference_logprobs(embedded_hf, ids), tokenizer,
                          top=3)
    chat = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 2})
    assert chat.status_code == 200, chat.text
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    check_prompt_logprobs(chat.json()["prompt_logprobs"], chat_ids, reference_logprobs(embedded_hf, chat_ids),
                          tokenizer, top=2)


def test_echo_with_logprobs_gives_the_prompt_tokens_top_logprobs(http, tokenizer, embedded_hf):
    """OpenAI's echo with logprobs=k: the echoed prompt tokens carry their k likeliest tokens, as generated ones do."""
    ids = tokenizer.encode(PROMPT)
    logprobs = complete(http, echo=True, logprobs=2, max_tokens=1)["choices"][0]["logprobs"]
    reference = reference_logprobs(embedded_hf, ids)
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"]) == len(ids) + 1
    for i in range(1, len(ids)):
        best = reference[i - 1].topk(2).indices.tolist()
        expected = {tokenizer.token_text(t) for t in [ids[i], *best]}
        assert set(logprobs["top_logprobs"][i]) == expected, (i, logprobs["top_logprobs"][i])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("body", [{"prompt_logprobs": 21}, {"prompt_logprobs": 0, "stream": True},
                                  {"prompt_logprobs": -1}])
def test_prompt_logprobs_refused_where_not_served(http, route, body):
    error = refused(http, route, body)
    assert "prompt_logprobs" in (error.get("param") or "") + error["message"]


# ---- include_stop_str_in_output ------------------------------------------------------------------


def streamed_text(http, body: dict) -> str:
    text = ""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_include_stop_str_in_output_keeps_the_stop_string(http):
    free = complete(http, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    words = free.split()
    assert len(words) >= 3, free
    stop = words[1]  # a stop string in the middle of the answer
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    cut = complete(http, **body)["choices"][0]
    kept = complete(http, **body, include_stop_str_in_output=True)["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and free.startswith(kept["text"])
    assert streamed_text(http, {**body, "include_stop_str_in_output": True}) == kept["text"]
    assert streamed_text(http, body) == cut["text"]


# ---- truncate_prompt_tokens ----------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_n(http, tokenizer):
    ids = tokenizer.encode(PROMPT)
    answer = complete(http, truncate_prompt_tokens=4, echo=True, max_tokens=4)
    assert answer["usage"]["prompt_tokens"] == 4
    last = complete(http, prompt=ids[-4:], max_tokens=4)
    kept = tokenizer.decode(ids[-4:], skip_special_tokens=False)
    assert answer["choices"][0]["text"] == kept + last["choices"][0]["text"]
    assert complete(http, truncate_prompt_tokens=10_000)["usage"]["prompt_tokens"] == len(ids)
    chat = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1, "truncate_prompt_tokens": 5})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 5
    error = refused(http, "completions", {"truncate_prompt_tokens": 0})
    assert "truncate_prompt_tokens" in (error.get("param") or "") + error["message"]


# ---- suffix (fill in the middle) -----------------------------------------------------------------


def test_suffix_refused_without_fill_in_the_middle_tokens(http):
    assert openai_inputs.fim_token_ids(http.app.state.loraplex.tokenizer.hf) is None  # SmolLM2 has none
    error = refused(http, "completions", {"suffix": "return x"})
    assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"]


def test_fim_tokens_found_by_name():
    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    star = Vocab({"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "a": 4})
    qwen = Vocab({"<|fim_prefix|>": 7, "<|fim_suffix|>": 8, "<|fim_middle|>": 9})
    assert openai_inputs.fim_token_ids(star) == (1, 3, 2)
    assert openai_inputs.fim_token_ids(qwen) == (7, 8, 9)
    assert openai_inputs.fim_token_ids(Vocab({"<fim_prefix>": 1, "<fim_suffix>": 3})) is None


def test_suffix_served_in_psm_order(http, tokenizer, monkeypatch):
    fim = (3, 4, 5)  # stand-ins: three special tokens of SmolLM2's vocabulary
    monkeypatch.setattr(openai_inputs, "fim_token_ids", lambda hf: fim)
    prompt, suffix = "def add(a, b):\n", "\n    return total\n"
    answer = complete(http, prompt=prompt, suffix=suffix, prompt_logprobs=0, max_tokens=2)
    ids = [fim[0], *tokenizer.encode(prompt, add_special_tokens=False), fim[1],
           *tokenizer.encode(suffix, add_special_tokens=False), fim[2]]
    scored = [int(next(iter(entry))) for entry in answer["choices"][0]["prompt_logprobs"][1:]]
    assert scored == ids[1:] and answer["usage"]["prompt_tokens"] == len(ids)
    for body in ({"echo": True}, {"truncate_prompt_tokens": 3}):
        error = refused(http, "completions", {"suffix": suffix, **body})
        assert error["param"] in ("suffix", "truncate_prompt_tokens")


# ---- spaces_between_special_tokens, refusals, ignored fields -------------------------------------


def test_spaces_between_special_tokens_both_served(http):
    # Our detokenizer (a fast tokenizer's decode) puts no spaces between special tokens: false is exact, and true
    # is what vLLM gives with a fast tokenizer. Neither changes this answer.
    base = complete(http, skip_special_tokens=False)["choices"][0]["text"]
    for value in (True, False):
        assert complete(http, skip_special_tokens=False, spaces_between_special_tokens=value)["choices"][0]["text"] == base


COMMON_REFUSED = [
    ("use_beam_search", True), ("length_penalty", 0.5), ("early_stopping", True), ("guided_grammar", "root ::= x"),
    ("guided_decoding_backend", "outlines"), ("guided_whitespace_pattern", " "), ("structural_tag", "{}"),
    ("logits_processors", ["x"]), ("return_tokens_as_token_ids", True), ("return_token_ids", True),
    ("priority", 1), ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}), ("mm_processor_kwargs", {"a": 1}),
]
CHAT_REFUSED = [
    ("echo", True), ("continue_final_message", True), ("add_generation_prompt", False), ("documents", [{"a": "b"}]),
    ("chat_template", "{{ x }}"), ("chat_template_kwargs", {"a": 1}), ("audio", {"voice": "x"}),
    ("prediction", {"type": "content"}), ("web_search_options", {}), ("reasoning_effort", "low"), ("store", True),
    ("modalities", ["text", "audio"]), ("service_tier", "flex"),
]


@pytest.mark.parametrize("route, name, value", [
    *(("completions", n, v) for n, v in COMMON_REFUSED), ("completions", "prompt_embeds", "AAAA"),
    *(("chat/completions", n, v) for n, v in COMMON_REFUSED + CHAT_REFUSED),
])
def test_unserved_fields_refused_by_name(http, route, name, value):
    error = refused(http, route, {name: value})
    assert error["param"] == name and name in error["message"]


def test_defaults_of_refused_fields_accepted_and_unknown_fields_logged(http, caplog):
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "guided_decoding_backend": "auto", "priority": 0,
                "echo": False, "add_generation_prompt": True, "service_tier": "auto", "store": False}
    with caplog.at_level(logging.DEBUG, logger="loraplex.protocol.openai"):
        response = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1, **defaults,
                                                           "no_such_field": 1, "another_one": "x"})
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if "ignored unknown request fields" in r.getMessage()]
    assert lines == ["ignored unknown request fields: another_one, no_such_field"]


# ---- through the openai client -------------------------------------------------------------------


def test_vllm_extras_through_the_openai_client(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    answer = client.completions.create(model="", prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0, "truncate_prompt_tokens": 6})
    assert answer.usage.prompt_tokens == 6
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and [int(next(iter(e))) for e in entries[1:]] == ids[-5:]
    reply = client.chat.completions.create(
        model="", messages=QUESTION, max_tokens=12, temperature=0, stop=["Paris"],
        extra_body={"include_stop_str_in_output": True, "spaces_between_special_tokens": False},
    )
    assert reply.choices[0].message.content.endswith("Paris")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=QUESTION, max_tokens=1, extra_body={"use_beam_search": True})
    assert "use_beam_search" in err.value.message
