"""OpenAI API conformance: the real `openai` client against a live `loraplex serve` (plus raw SSE with httpx),
and the n-stream merge driven directly with fake streams (mid-stream errors, disconnects)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.requests.output import RequestOutput
from loraplex.engine.requests.request import RequestRefused
from loraplex.params import FinishReason, SamplingParams, TokenInfo
from loraplex.server.admission import Admission
from loraplex.server.app import create_app
from loraplex.server.openai_inputs import Job
from loraplex.server.openai_routes import Renderer, start_all, stream_events
from loraplex.server.state import GenerationFailed
from tests.helpers import live_server, metric_value

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server():
    # 16 seats: a request may make a quarter of them (server/admission.py sequences_per_request), and the tests
    # here ask for 4 (2 prompts x n=2); the shared api_server's 4 seats would allow 1.
    with live_server("--max-batch-total-tokens", "8192", "--max-concurrent-requests", "16") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def serves(client: openai.OpenAI) -> None:
    """The server still answers after an error."""
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert answer.usage.completion_tokens == 1


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "loraplex" and models[0].created > 0
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_and_its_stream_agree(client):
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion" and answer.model == MODEL
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = answer.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1].choices[0]
    assert last.finish_reason == choice.finish_reason and not last.delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_completion_and_its_stream_agree_with_usage(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert answer.id.startswith("cmpl-") and answer.object == "text_completion"
    assert answer.choices[0].text and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens

    chunks = list(client.completions.create(model="", prompt="The capital of France is", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].model == MODEL
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == answer.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == answer.choices[0].text
    assert chunks[-2].choices[0].finish_reason == answer.choices[0].finish_reason


def test_chat_stream_wire_format(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 4
    assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] == "length"


def test_n_choices_plain_and_streamed(client):
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, n=2, seed=7)
    assert [c.index for c in answer.choices] == [0, 1] and all(c.message.content for c in answer.choices)
    assert 2 <= answer.usage.completion_tokens <= 10  # both choices count
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, n=2, seed=7, stream=True))
    by_index: dict[int, list] = {0: [], 1: []}
    for c in chunks:
        by_index[c.choices[0].index].append(c.choices[0])
    for i, choices in by_index.items():
        assert choices[0].delta.role == "assistant" and choices[-1].finish_reason is not None
        # Seeds are seed + i per choice: streamed and plain draw the same tokens.
        assert "".join(c.delta.content or "" for c in choices) == answer.choices[i].message.content
    prompts = client.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=2, n=2, temperature=0)
    assert [c.index for c in prompts.choices] == [0, 1, 2, 3]
    assert prompts.choices[0].text == prompts.choices[1].text  # greedy n>1: identical choices, as vLLM


def test_stop_sequences_cut_the_text_streamed_or_not(client):
    prompt = "Count: one, two, three, four, five,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    stop = full.strip()[2:5]  # a stop string starting inside the greedy text
    assert stop and stop in full
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_seed_makes_sampling_repeatable(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1), sample(2), sample(3)}) > 1  # it does sample


def test_chat_logprobs_with_alternatives(client):
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    chunks = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_completion_logprobs_and_echo(client):
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == answer.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    choice = echoed.choices[0]
    assert choice.text == prompt + answer.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + echoed.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1] <= 0
    assert choice.logprobs.text_offset[n_prompt] == len(prompt)


def test_completion_prompt_forms_extras_and_best_of(client):
    ids = client.completions.create(model=MODEL, prompt=[504, 3156], max_tokens=2, temperature=0, echo=True)
    assert ids.usage.prompt_tokens == 2 and ids.choices[0].text.startswith("The")
    extras = {"top_k": 5, "repetition_penalty": 1.1, "min_p": 0.05, "ignore_eos": True, "adapter_source": "hub",
              "api_token": "t"}
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, seed=3, user="u", extra_body=extras)
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"
    best = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=2, n=1, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.usage.completion_tokens == 4  # both runs generated
    for fields, named in (({"suffix": "x"}, "no fill-in-the-middle tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                          ({"best_of": 3}, "max best of"), ({"prompt": [[1, 2], "x"]}, "prompt")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields})
        assert named in err.value.message
    serves(client)


def test_unknown_model_is_404(client):
    """A model name that is neither the base nor an adapter: 404 from the hub, or 503 where this machine cannot
    reach the hub to ask (as CI's cannot): never a 404 that hides a network failure."""
    with pytest.raises((openai.NotFoundError, openai.InternalServerError)) as err:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=1)
    assert "no-such-model" in err.value.message
    if isinstance(err.value, openai.NotFoundError):
        assert err.value.code == "model_not_found"
    else:
        assert err.value.status_code == 503 and err.value.code == "adapter_source_unavailable"
        assert "cannot be reached" in err.value.message
    serves(client)


@pytest.mark.parametrize("field,value", [("temperature", 5), ("n", 0), ("top_p", 2), ("top_logprobs", 30)])
def test_bad_field_is_400_naming_it(client, field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, **{field: value}, **extra)
    assert err.value.param == field and field in err.value.message
    serves(client)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("request_fields,named", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # OpenAI's deprecated form of tools
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
     "does not take images"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "max stop sequences"),
    ({"max_tokens": 100000}, "max total tokens"),
    ({"messages": [{"role": "user", "content": "hi " * 5000}]}, "max input length"),
])
def test_unsupported_or_over_the_limit_is_400(client, request_fields, named):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": MODEL, "messages": HELLO, "max_tokens": 1, **request_fields})
    assert named in err.value.message
    serves(client)


def test_closed_n_stream_frees_every_slot(server, client):
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True, "n": 2,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        seen: set[int] = set()
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
                if seen == {0, 1}:  # both choices are streaming (a slot each): leave now
                    break
    # The server notices the disconnect on its own schedule: poll (bounded) until the engine is idle.
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(f"{server}/metrics", timeout=10).text
        running = metric_value(metrics, "vllm:num_requests_running")
        if running == 0 or time.monotonic() > deadline:
            break
    assert running == 0
    serves(client)


# ---- the merge of n streams, with fake engine streams -------------------------------------------


class FakeState:
    """Streams tokens "a", "b", ...; `fail_at` maps a stream number to the step where it fails."""

    def __init__(self, length: int | None = None, fail_at: dict[int, int] | None = None, refuse: int | None = None):
        self.length, self.fail_at, self.refuse = length, fail_at or {}, refuse
        self.opened = 0
        self.closed: set[int] = set()
        self.admission = Admission()  # the request's seats, as ServerState keeps them

    def admit_all(self, sequences):
        return self.admission.admit_all(sequences, 8, None)

    def release_all(self, seats):
        for seat in seats:
            self.admission.release(seat)

    async def generate(self, prompt_ids, params, adapter=None, images=None, seat=None):
        number, self.opened = self.opened, self.opened + 1
        try:
            if number == self.refuse:
                raise RequestRefused("refused")
            step = 0
            while True:
                if self.fail_at.get(number) == step:
                    raise GenerationFailed("generation failed: boom")
                text = chr(ord("a") + step % 26)
                done = self.length is not None and step + 1 == self.length
                yield RequestOutput(
                    f"r{number}", TokenInfo(step, text, -0.5), finished=done, num_generated_tokens=step + 1,
                    finish_reason=FinishReason.LENGTH if done else None,
                    generated_text="abcdefgh"[: step + 1] if done else None,
                )
                if done:
                    return
                step += 1
                await asyncio.sleep(0)  # let the other streams run, as the engine's queue would
        finally:
            self.closed.add(number)
            self.admission.release(seat)


def _jobs(n: int) -> list[Job]:
    return [Job(i, 0, [1, 2], SamplingParams()) for i in range(n)]


def _render() -> Renderer:
    return Renderer(opening=lambda job: None, content=lambda job, text, tokens: [{"i": job.index, "text": text}],
                    finish=lambda job, reason: [{"i": job.index, "finish": reason}],
                    usage=lambda u: {"usage": u.model_dump()})


async def _collect(state: FakeState, n: int, take: int | None = None) -> list[str]:
    jobs = _jobs(n)
    events = stream_events(jobs, await start_all(state, jobs), [], False, True, _render())
    out = []
    async for e in events:
        out.append(e)
        if take is not None and len(out) == take:
            await events.aclose()  # what the server does when the client goes away
            break
    return out


def test_merged_streams_finish_each_choice_then_usage():
    events = asyncio.run(_collect(FakeState(length=3), n=3))
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n" and payloads[-1]["usage"]["completion_tokens"] == 9
    for i in range(3):
        assert "".join(p.get("text", "") for p in payloads if p.get("i") == i) == "abc"
        assert [p for p in payloads if p.get("i") == i][-1] == {"i": i, "finish": "length"}


def test_disconnect_closes_all_n_streams():
    state = FakeState()
    asyncio.run(_collect(state, n=3, take=5))
    assert state.opened == 3 and state.closed == {0, 1, 2} and state.admission.in_flight == 0


def test_error_mid_stream_is_an_error_event_and_closes_the_rest():
    state = FakeState(fail_at={1: 2})
    events = asyncio.run(_collect(state, n=2))
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2][6:])["error"]
    assert error["message"] == "generation failed: boom" and error["type"] == "server_error"
    assert state.closed == {0, 1}


def test_a_refused_choice_refuses_the_request_and_closes_the_others():
    state = FakeState(refuse=2)
    with pytest.raises(RequestRefused):
        asyncio.run(_collect(state, n=3))
    assert state.closed == {0, 1, 2} and state.admission.in_flight == 0  # no seat stays taken


# ---- an engine failure in the middle of an n=2 stream, in-process -------------------------------


def test_engine_failure_mid_stream_is_an_error_event_then_done(make_engine):
    engine = make_engine(max_batch_total_tokens=2048)
    execute, calls = engine.runner.execute, []

    def fail_from_third(scheduled, *args):
        """Prefill, one decode step, then the streamed request's steps fail, retried or not (a transient failure
        would be contained: engine/containment.py re-runs a failed step)."""
        calls.append(1)
        if len(calls) >= 3 and any(item.request.params.max_new_tokens == 10 for item in scheduled):
            raise RuntimeError("injected device failure")
        return execute(scheduled, *args)

    engine.runner.execute = fail_from_third
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine)
    body = {"model": "", "messages": HELLO, "max_tokens": 10, "n": 2, "stream": True, "extra": "ignored",
            "ignore_eos": True}

    async def talk() -> tuple[list[str], int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as response:
                data = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
            after = await c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
            return data, after.status_code

    try:
        data, status_after = asyncio.run(talk())
    finally:
        async_engine.shutdown()
    assert data[-1] == "[DONE]" and "injected device failure" in json.loads(data[-2])["error"]["message"]
    assert {json.loads(d)["choices"][0]["index"] for d in data[:-2]} == {0, 1}  # both choices had started
    assert status_after == 200 and engine.scheduler.allocator.num_used == 0


def test_default_max_tokens_caps_requests_that_name_none(embedded):
    """--default-max-tokens: chat (else up to the context limit) and completions (else 16) without max_tokens stop
    there; a request's own max_tokens still rules."""
    from fastapi.testclient import TestClient

    from loraplex.config import EngineConfig, ServerConfig
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.engine import Engine
    from loraplex.server.app import create_app

    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048))
    with TestClient(create_app(AsyncEngine(engine), ServerConfig(default_max_tokens=3))) as http:
        capped = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        chat = capped.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
        text = capped.completions.create(model=MODEL, prompt="Once", extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 3
        own = capped.completions.create(model=MODEL, prompt="Once", max_tokens=5, extra_body={"ignore_eos": True})
        assert own.usage.completion_tokens == 5
