"""Token budgets on the token routes (issue 58, item 2): /tokenize refuses past --max-input-length tokens before it
builds its answer, /detokenize past --max-total-tokens, and both run on their own bounded pool of validation workers,
so that a flood of them neither delays generation's prompts nor queues without bound (a full pool: 429)."""

from __future__ import annotations

import random
import statistics
import threading
import time

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server import native
from loraplex.server.app import create_app

MAX_INPUT = 64
SMALL = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
# A /generate measured alone and then beside 8 clients that send /tokenize without pause: on 2 cores it may take
# this much longer (before the token routes had a budget and a pool of their own it waited seconds).
FLOOD_DELAY_S = 1.5


@pytest.fixture(scope="module")
def client(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096, max_input_length=MAX_INPUT))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig())) as c:
        yield c


def rare_cjk(chars: int) -> str:
    """CJK Extension B characters: about four tokens each for a byte-level BPE."""
    rng = random.Random(chars)
    return "".join(chr(rng.randint(0x20000, 0x2A6DF)) for _ in range(chars))


def test_tokenize_past_the_max_input_length_is_refused_naming_the_limit(client):
    validation = client.app.state.loraplex.validation
    text = rare_cjk(validation.max_chars - 10)  # under the character bound: only the token count refuses it
    refused = client.post("/tokenize", json={"inputs": text})
    assert refused.status_code == 422, refused.text[:200]
    assert refused.json()["error_type"] == "validation"
    assert "inputs has" in refused.text and f"more than {MAX_INPUT} (max input length)" in refused.text
    assert len(refused.content) < 1000  # no per-token answer was built
    under = client.post("/tokenize", json={"inputs": " ".join(["word"] * (MAX_INPUT - 4))})
    assert under.status_code == 200 and len(under.json()) == MAX_INPUT - 4
    # /detokenize: a sequence has at most --max-total-tokens.
    total = client.app.state.loraplex.model.max_total_tokens
    long = client.post("/detokenize", json={"tokens": [42] * (total + 1)})
    assert long.status_code == 422 and f"tokens has {total + 1} tokens, more than {total} (max total tokens)" in long.text
    assert client.post("/detokenize", json={"tokens": [42] * total}).status_code == 200


def test_a_tokenize_flood_does_not_delay_generation(client):
    def small_generate() -> float:
        started = time.perf_counter()
        assert client.post("/generate", json=SMALL).status_code == 200
        return time.perf_counter() - started

    small_generate()  # warm
    alone = statistics.median(small_generate() for _ in range(3))
    text = rare_cjk(client.app.state.loraplex.validation.max_chars - 10)  # the longest each may be
    stop, statuses, lock = threading.Event(), [], threading.Lock()

    def flood() -> None:
        while not stop.is_set():
            status = client.post("/tokenize", json={"inputs": text}).status_code
            with lock:
                statuses.append(status)

    senders = [threading.Thread(target=flood) for _ in range(8)]
    for sender in senders:
        sender.start()
    try:
        while len(statuses) < 8:  # the flood under way
            time.sleep(0.01)
        during = max(small_generate() for _ in range(3))
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    print(f"small /generate: {alone:.3f} s alone, at most {during:.3f} s during the flood ({len(statuses)} /tokenize)")
    assert during - alone < FLOOD_DELAY_S, f"{during:.2f} s during the flood, {alone:.2f} s alone"
    assert set(statuses) <= {422, 429}, set(statuses)  # each refused by its tokens (or a full pool), no answer built


def test_a_full_token_pool_answers_429_and_generation_goes_on(client, monkeypatch):
    validation = client.app.state.loraplex.validation
    pool = validation.token_pool
    monkeypatch.setattr(pool, "queue", 1)
    gate, original = threading.Event(), native._encode_with_offsets

    def gated(*args, **kwargs):
        gate.wait(timeout=60)
        return original(*args, **kwargs)

    monkeypatch.setattr(native, "_encode_with_offsets", gated)
    held = pool.workers + pool.queue
    answers: list = []
    senders = [threading.Thread(target=lambda: answers.append(client.post("/tokenize", json={"inputs": "Hi there"})))
               for _ in range(held)]
    try:
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 30
        while pool.held < held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.held == held
        full = client.post("/tokenize", json={"inputs": "Hello"})
        assert full.status_code == 429 and full.json()["error_type"] == "overloaded", full.text
        assert int(full.headers["Retry-After"]) >= 1
        assert f"at most {pool.workers} workers + 1 queued" in full.json()["error"]
        detokenize = client.post("/detokenize", json={"tokens": [42, 43]})
        assert detokenize.status_code == 429 and "Retry-After" in detokenize.headers
        # Generation's prompts have their own workers: a small /generate answers while the token pool is full.
        generated: list = []
        small = threading.Thread(target=lambda: generated.append(client.post("/generate", json=SMALL)))
        small.start()
        small.join(timeout=30)
        assert generated and generated[0].status_code == 200
    finally:
        gate.set()
        for sender in senders:
            sender.join(timeout=30)
    assert [a.status_code for a in answers] == [200] * held
    assert pool.held == 0
    assert client.post("/tokenize", json={"inputs": "Hello"}).status_code == 200
