"""Fairness (issue 58, item 7): `n` and `best_of` count against --max-concurrent-requests as the sequences they
make, a seat each, admitted all at once; one request may make at most a quarter of the seats
(server/admission.py `sequences_per_request`), more is refused at once with 400 (422 native) naming the field,
so that one request never takes every seat and other clients still find one."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.admission import Admission, Overloaded, sequences_per_request
from loraplex.server.app import create_app

MAX_CONCURRENT = 8
SHARE = 2  # a quarter of 8
WAIT_S = 60


# ---- the rule and the bookkeeping ----------------------------------------------------------------


def test_a_request_may_make_a_quarter_of_the_seats_at_least_one():
    assert [sequences_per_request(m) for m in (1, 3, 4, 7, 8, 128)] == [1, 1, 1, 1, 2, 32]
    assert sequences_per_request(MAX_CONCURRENT) == SHARE
    # --max-sequences-per-request sets it (an evaluation harness's batches of prompts), within the seats.
    assert [sequences_per_request(128, asked) for asked in (1, 64, 500)] == [1, 64, 128]


def test_the_share_is_a_flag(embedded):
    from fastapi.testclient import TestClient

    from loraplex.config import EngineConfig, ServerConfig
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.engine import Engine
    from loraplex.server.app import create_app

    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    config = ServerConfig(max_concurrent_requests=8, max_sequences_per_request=6)
    with TestClient(create_app(AsyncEngine(engine), config)) as client:
        prompt = {"prompt": "Hi", "max_tokens": 1}
        assert client.post("/v1/completions", json={**prompt, "n": 6}).status_code == 200
        refused = client.post("/v1/completions", json={**prompt, "n": 7})
        assert refused.status_code == 400 and "--max-sequences-per-request" in refused.json()["error"]["message"]


def test_a_requests_sequences_are_admitted_all_or_none_and_each_released_once():
    admission = Admission()
    first = admission.admit_all([(5, 10), (5, 10)], max_requests=4, max_tokens=None)
    assert (admission.in_flight, admission.queued_tokens, admission.pending_output_tokens) == (2, 30, 20)
    other = admission.admit(1, 1, max_requests=4, max_tokens=None)
    with pytest.raises(Overloaded, match=r"3 sequences in flight \+ 2 of this request > 4 \(max concurrent requests\)"):
        admission.admit_all([(5, 10), (5, 10)], max_requests=4, max_tokens=None)
    assert admission.in_flight == 3  # the refused request took no seat
    with pytest.raises(Overloaded, match="max queued tokens"):
        admission.admit_all([(5, 10), (5, 10)], max_requests=8, max_tokens=40)
    for seat in [*first, first[0], other, other]:  # a seat given back twice counts once
        admission.release(seat)
    assert (admission.in_flight, admission.queued_tokens, admission.pending_output_tokens) == (0, 0, 0)


# ---- the routes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(embedded):
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096)))
    config = ServerConfig(max_concurrent_requests=MAX_CONCURRENT, max_best_of=4)
    with TestClient(create_app(engine, config)) as c:
        yield c
    engine.shutdown()


@pytest.fixture
def admissions(client, monkeypatch):
    """(sequences, seats already in flight) of every request admitted from now on."""
    admission = client.app.state.loraplex.admission
    seen: list[tuple[int, int]] = []
    admit_all = admission.admit_all

    def recording(sequences, *args, **kwargs):
        before = admission.in_flight
        seats = admit_all(sequences, *args, **kwargs)
        seen.append((len(sequences), before))
        return seats

    idle = threading.Event()
    release = admission.release

    def releasing(seat):  # on the event loop
        release(seat)
        if admission.in_flight == 0:
            idle.set()

    monkeypatch.setattr(admission, "admit_all", recording)
    monkeypatch.setattr(admission, "release", releasing)
    yield seen
    # A closed stream's sequences are aborted on the app's side after the client has moved on: wait for them.
    assert admission.in_flight == 0 or idle.wait(WAIT_S)
    assert admission.in_flight == 0 and admission.queued_tokens == 0  # nothing left taken


def in_flight_gauge(client) -> float:
    text = client.get("/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "loraplex_requests_in_flight")


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path,body,param,got", [
    ("/v1/completions", {"prompt": "Hi", "n": SHARE + 1}, "n", SHARE + 1),
    ("/v1/completions", {"prompt": "Hi", "n": 1, "best_of": SHARE + 1}, "best_of", SHARE + 1),
    ("/v1/completions", {"prompt": ["Hi", "Ho"], "n": SHARE}, "n", 2 * SHARE),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt", 3),
    ("/v1/chat/completions", {"messages": CHAT, "n": SHARE + 1}, "n", SHARE + 1),
])
def test_openai_over_the_share_is_400_naming_the_field_and_the_bound(client, admissions, path, body, param, got):
    response = client.post(path, json={"model": "", "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith(param if param != "prompt" else "the number of prompts")
    assert f"must be <= {SHARE} (--max-sequences-per-request" in error["message"]
    assert f"--max-concurrent-requests {MAX_CONCURRENT}" in error["message"] and f"got {got}" in error["message"]
    assert admissions == []  # refused before any seat


def test_native_best_of_over_the_share_is_422_naming_it(client, admissions):
    params = {"max_new_tokens": 1, "best_of": SHARE + 1, "do_sample": True}
    response = client.post("/generate", json={"inputs": "Hi", "parameters": params})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation"
    assert body["error"].startswith(f"best_of must be <= {SHARE} (--max-sequences-per-request")
    assert admissions == []


def test_n_within_the_share_takes_a_seat_per_sequence_and_leaves_seats_for_others(client, admissions):
    # Long enough that the other requests below come while it runs (their admissions record its seats held).
    body = {"model": "", "prompt": "Write a long story.", "max_tokens": 48, "ignore_eos": True, "n": SHARE,
            "stream": True}
    state = client.app.state.loraplex
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept open (a `for ... break` would close the response)
        seen: set[int] = set()
        while seen != set(range(SHARE)):  # until every choice is generating
            line = next(lines)
            if line.startswith("data: ") and line != "data: [DONE]":
                seen.add(json.loads(line[6:])["choices"][0]["index"])
        assert admissions == [(SHARE, 0)]  # one request, admitted as its SHARE sequences at once
        assert state.admission.in_flight == SHARE and in_flight_gauge(client) == SHARE
        other = client.post("/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": 1})
        assert other.status_code == 200, other.text
        native = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}})
        assert native.status_code == 200, native.text
        assert admissions[1:] == [(1, SHARE), (1, SHARE)]  # admitted while the n request held its seats
        assert state.admission.in_flight == SHARE
        # Read to its end: the test client's close would leave the app's stream to be cancelled on its own time.
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)


def test_native_best_of_within_the_share_is_admitted_as_its_sequences(client, admissions):
    state = client.app.state.loraplex
    admission = state.admission
    generating: set[int] = set()
    both = threading.Event()
    generated = admission.generated

    def watching(seat, tokens=1):  # on the event loop: every sequence's tokens
        generating.add(id(seat))
        if len(generating) == SHARE:
            both.set()
        return generated(seat, tokens)

    admission.generated = watching
    try:
        params = {"max_new_tokens": 48, "ignore_eos_token": True, "best_of": SHARE, "do_sample": True,
                  "details": True}
        answer: list = []
        runner = threading.Thread(target=lambda: answer.append(
            client.post("/generate", json={"inputs": "Once upon a time", "parameters": params})))
        runner.start()
        assert both.wait(WAIT_S)  # both sequences are generating
        assert admissions == [(SHARE, 0)]
        other = client.post("/v1/chat/completions", json={"model": "", "messages": CHAT, "max_tokens": 1})
        assert other.status_code == 200, other.text
        runner.join(WAIT_S)
    finally:
        del admission.generated
    assert admissions[1:] == [(1, SHARE)]  # the other client was admitted while best_of held its seats
    assert answer and answer[0].status_code == 200, answer
    assert len(answer[0].json()["details"]["best_of_sequences"]) == SHARE - 1
