"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Each choice (n per prompt) is one engine request run through `ServerState.generate`; the n run
concurrently, and a streamed answer merges their outputs into one SSE stream. Errors before the
first output are plain OpenAI errors (errors.py); an error mid-stream is an SSE `error` event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.engine.requests.output import RequestOutput
from loraplex.lora.adapter import LoraAdapter
from loraplex.params import TokenInfo
from loraplex.protocol.embeddings import EmbeddingRequest
from loraplex.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from loraplex.protocol.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    finish_reason_name,
    prompt_logprobs_of,
)
from loraplex.server.chat_tools import AnswerStream
from loraplex.server.docs import JSON_OR_EVENTS
from loraplex.server.errors import OPENAI_GENERATE_ERRORS, BadRequest, ModelNotFound, documented_errors
from loraplex.server.admission import Seat
from loraplex.server.counted_route import CountedRoute
from loraplex.server.openai_inputs import Job, prepare_chat, prepare_completion
from loraplex.server.request_log import note_adapter
from loraplex.server.state import (
    Finished,
    GenerationFailed,
    ServerState,
    adapter_header,
    get_state,
    run_to_end,
)

router = APIRouter(prefix="/v1", route_class=CountedRoute)  # bodies parsed and counted off the loop
ERRORS = documented_errors(True, *OPENAI_GENERATE_ERRORS)

# ---- models --------------------------------------------------------------------------------------


def served_model_ids(state: ServerState) -> list[str]:
    """The base model (its --served-model-name names, else its id), then every named, loaded or preloaded adapter
    (a stable order; any other adapter id loads on request)."""
    return [*(state.config.served_model_name or (state.model_id,)), *sorted(state.adapters.loaded_ids())]


@dataclass(frozen=True)
class Served:
    """What a request's `model` names: the base model, or an adapter on it."""

    name: str
    adapter: LoraAdapter | None = None


async def resolve_model(state: ServerState, body: SamplingFields | EmbeddingRequest) -> Served:
    """"" / no model / the base model id: the base model; anything else is an adapter id, loaded now. LoRAX's
    `adapter_id` extra names the adapter too (with `model` empty, the base model's id, or the same adapter).

    Raises AdapterNotFound (404), AdapterInvalid or BadRequest (400): never a silent answer from the base model.
    """
    requested = body.model if body.model not in state.base_names else None
    if not body.model and not body.adapter_id:  # names nothing: --adapter-id's adapter, if any
        requested = state.config.default_adapter_id
    if body.adapter_id:
        store, source = state.adapters, body.adapter_source
        if requested and store.key(requested, source) != store.key(body.adapter_id, source):  # aliases agree
            raise BadRequest(f"model {body.model!r} and adapter_id {body.adapter_id!r} name different adapters",
                             "adapter_id")
        requested = body.adapter_id
    if not requested:
        return Served(state.model_id)
    note_adapter(requested)  # for its log line and metrics
    return Served(requested, await state.adapter(requested, body.adapter_source, api_token=body.api_token))


def model_card(state: ServerState, model_id: str) -> ModelCard:
    named = state.adapters.named.get(model_id)
    parent = None if model_id in state.base_names else (named and named.base_model_name) or state.model_id
    modalities = ["text", "image"] if state.model.takes_images else ["text"]
    return ModelCard(id=model_id, created=int(state.started_at), root=state.model_id, parent=parent,
                     input_modalities=modalities)


@router.get("/models")
async def list_models(request: Request):
    state = get_state(request)
    return ModelList(data=[model_card(state, m) for m in served_model_ids(state)]).model_dump()


@router.get("/models/{model_id:path}", responses=documented_errors(True, 404))
async def retrieve_model(model_id: str, request: Request):
    state = get_state(request)
    if model_id not in served_model_ids(state):
        raise ModelNotFound(f"The model `{model_id}` is not loaded: this server serves {', '.join(served_model_ids(state))}")
    return model_card(state, model_id).model_dump()


# ---- running: n engine requests at once ----------------------------------------------------------


async def all_or_none(coros: list) -> list:
    """Run concurrently; when one fails (or the caller is cancelled) cancel the rest and wait for them."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def admit_jobs(state: ServerState, jobs: list[Job]) -> list[Seat]:
    """A seat for every job (sequence) of the request at once, or Overloaded (429): all of them or none."""
    return state.admit_all([(len(job.prompt_ids), job.params.max_new_tokens) for job in jobs])


async def run_all(state: ServerState, jobs: list[Job], adapter: LoraAdapter | None) -> list[Finished]:
    seats = admit_jobs(state, jobs)
    try:
        return await all_or_none([
            run_to_end(state, job.prompt_ids, job.params, adapter, job.images, seat) for job, seat in zip(jobs, seats)
        ])
    finally:  # each run gives its seat back as it ends; these are the runs cancelled before they began
        state.release_all(seats)


Started = list[tuple[AsyncIterator[RequestOutput], RequestOutput]]


async def start_all(state: ServerState, jobs: list[Job], adapter: LoraAdapter | None = None) -> Started:
    """Every job's first output, so that refusals come back as plain errors; on failure none stays open (nor any
    of the request's seats). Each stream gives its seat back as it ends."""
    seats = admit_jobs(state, jobs)
    streams = [state.generate(job.prompt_ids, job.params, adapter, job.images, seat) for job, seat in zip(jobs, seats)]

    async def first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        return await anext(stream)

    try:
        return list(zip(streams, await all_or_none([first(s) for s in streams])))
    except BaseException:
        for s in streams:
            await s.aclose()
        state.release_all(seats)
        raise


async def merge(started: Started) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(job position, output) from all streams as they come. Closing this closes (aborts) every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as exc:  # noqa: BLE001 — handed to the reader, which ends the response
            queue.put_nowait((i, None, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, (s, _) in enumerate(started)]
    try:
        for i, (_, first) in enumerate(started):
            yield i, first
        running = sum(not first.finished for _, first in started)
        while running:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            yield i, out
            running -= out.finished
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- rendering -----------------------------------------------------------------------------------


def usage(jobs: list[Job], finals: list[RequestOutput]) -> UsageInfo:
    """Each prompt counts once, however many choices it has; every choice's tokens count."""
    prompts = {j.prompt_index: len(j.prompt_ids) for j in jobs}
    return UsageInfo.of(sum(prompts.values()), sum(f.num_generated_tokens for f in finals))


@dataclass
class ChoiceStream:
    """One streamed choice's text: holds back the tail a stop sequence could still claim (as vLLM does)."""

    hold: int
    text: str = ""
    sent: int = 0
    pending: list[TokenInfo] = field(default_factory=list)

    def advance(self, out: RequestOutput) -> str:
        if out.token is not None:
            self.pending.append(out.token)
        if out.finished:
            full, upto = out.generated_text or "", len(out.generated_text or "")
        else:
            self.text += out.token.text if out.token else ""
            full, upto = self.text, len(self.text) - self.hold
        delta = full[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta

    def take(self) -> list[TokenInfo]:
        tokens, self.pending = self.pending, []
        return tokens


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"  # never a literal NaN


@dataclass
class Renderer:
    """How one API spells its chunks: `content(job, text, tokens-or-None)` and `finish(job, reason)` give the
    chunks for a piece of a choice's text (none while a tool call is being read) and for its end."""

    opening: Callable[[Job], dict | None]
    content: Callable[[Job, str, list[TokenInfo] | None], list[dict]]
    finish: Callable[[Job, str], list[dict]]
    usage: Callable[[UsageInfo], dict]


async def stream_events(
    jobs: list[Job], started: Started, stops: list[str], logprobs: bool, include_usage: bool, render: Renderer
) -> AsyncIterator[str]:
    def chunk(payload: dict) -> str:
        if not include_usage:
            payload.pop("usage", None)
        return sse(payload)

    choices = [ChoiceStream(hold=max((len(s) for s in stops), default=1) - 1) for _ in jobs]
    finals: list[RequestOutput] = []
    outputs = merge(started)
    try:
        for job in jobs:
            if (opening := render.opening(job)) is not None:
                yield chunk(opening)
        async for i, out in outputs:
            job, choice = jobs[i], choices[i]
            delta = choice.advance(out)
            if delta or (out.finished and logprobs and choice.pending):
                tokens = choice.take()  # the tokens that made this text
                for payload in render.content(job, delta, tokens if logprobs else None):
                    yield chunk(payload)
            if out.finished:
                finals.append(out)
                for payload in render.finish(job, finish_reason_name(out.finish_reason)):
                    yield chunk(payload)
        if include_usage:
            yield sse(render.usage(usage(jobs, finals)))
    except GenerationFailed as exc:
        yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
    finally:
        await outputs.aclose()  # a client that went away aborts all n requests here
    yield "data: [DONE]\n\n"


# ---- routes --------------------------------------------------------------------------------------


@router.post("/completions", responses={**JSON_OR_EVENTS, **ERRORS})
async def completions(body: CompletionRequest, request: Request):
    state = get_state(request)
    jobs = await prepare_completion(state, body)
    served = await resolve_model(state, body)
    model = served.name
    rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.choices_per_prompt
    if body.stream:
        started = await start_all(state, jobs, served.adapter)
        offsets = {job.index: len(job.echo) for job in jobs}

        def content(job: Job, text: str, tokens: list[TokenInfo] | None) -> dict:
            logprobs = None
            if tokens is not None:
                logprobs = CompletionLogprobs()
                offsets[job.index] = logprobs.extend(tokens, offsets[job.index], state.tokenizer.token_text)
            return CompletionChunk(id=rid, created=created, model=model, choices=[
                CompletionChoice(index=job.index, text=text, logprobs=logprobs)]).model_dump()

        render = Renderer(
            opening=lambda job: content(job, job.echo, None) if job.echo else None,
            content=lambda job, text, tokens: [content(job, text, tokens)],
            finish=lambda job, reason: [CompletionChunk(id=rid, created=created, model=model, choices=[
                CompletionChoice(index=job.index, text="", finish_reason=reason)]).model_dump()],
            usage=lambda u: CompletionChunk(id=rid, created=created, model=model, choices=[], usage=u).model_dump(),
        )
        events = stream_events(jobs, started, body.stops, body.logprobs is not None, body.include_usage, render)
        return StreamingResponse(events, media_type="text/event-stream", headers=adapter_header(served.adapter))

    results = await run_all(state, jobs, served.adapter)
    choices = []
    for p in sorted({job.prompt_index for job in jobs}):
        runs = [(job, r) for job, r in zip(jobs, results) if job.prompt_index == p]
        if len(runs) > n:  # best_of: the n most likely
            runs = sorted(runs, key=lambda jr: jr[1].logprob_sum, reverse=True)[:n]
        for k, (job, r) in enumerate(runs):
            logprobs = None
            if body.logprobs is not None:
                logprobs = CompletionLogprobs()
                logprobs.extend(r.final.prompt_tokens or [] if job.echo else [], 0, state.tokenizer.token_text)
                logprobs.extend(r.tokens, len(job.echo), state.tokenizer.token_text)
            prompt_logprobs = None
            if body.prompt_logprobs is not None:  # vLLM's, on each choice
                prompt_logprobs = prompt_logprobs_of(r.final.prompt_tokens, state.tokenizer.token_text)
            choices.append(CompletionChoice(index=p * n + k, text=job.echo + (r.final.generated_text or ""),
                                            logprobs=logprobs, finish_reason=finish_reason_name(r.final.finish_reason),
                                            prompt_logprobs=prompt_logprobs))
    response = CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage(jobs, [r.final for r in results]))
    return JSONResponse(response.model_dump(), headers=adapter_header(served.adapter))


@router.post("/chat/completions", responses={**JSON_OR_EVENTS, **ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    jobs, answers = await prepare_chat(state, body)
    served = await resolve_model(state, body)
    model = served.name
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        started = await start_all(state, jobs, served.adapter)
        streams: dict[int, AnswerStream] = {job.index: answers.stream() for job in jobs}

        def chunk(job: Job, delta: DeltaMessage, **fields) -> dict:
            choice = ChatStreamChoice(index=job.index, delta=delta, **fields)
            return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]).model_dump()

        def content(job: Job, text: str, tokens: list[TokenInfo] | None) -> list[dict]:
            deltas = streams[job.index].content(text)
            if tokens is None:
                return [chunk(job, d) for d in deltas]
            # The tokens' logprobs ride on the first chunk they made (an empty delta while a call is read).
            logprobs = ChoiceLogprobs.of(tokens, state.tokenizer.token_text)
            first, *rest = deltas or [DeltaMessage()]
            return [chunk(job, first, logprobs=logprobs), *(chunk(job, d) for d in rest)]

        def finish(job: Job, reason: str) -> list[dict]:
            deltas, reason = streams[job.index].finish(reason)
            return [*(chunk(job, d) for d in deltas), chunk(job, DeltaMessage(), finish_reason=reason)]

        render = Renderer(
            # An answer constrained to tool calls has no content, not even an empty one.
            opening=lambda job: chunk(job, DeltaMessage(role="assistant", content=None if answers.plan.calls_only else "")),
            content=content,
            finish=finish,
            usage=lambda u: ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=u).model_dump(),
        )
        events = stream_events(jobs, started, body.stops, bool(body.logprobs), body.include_usage, render)
        return StreamingResponse(events, media_type="text/event-stream", headers=adapter_header(served.adapter))

    results = await run_all(state, jobs, served.adapter)
    choices = []
    for job, r in zip(jobs, results):
        message, reason = answers.message(r.final.generated_text or "", r.final.finish_reason)
        choices.append(ChatChoice(
            index=job.index, message=message, finish_reason=reason,
            logprobs=ChoiceLogprobs.of(r.tokens, state.tokenizer.token_text) if body.logprobs else None,
        ))
    prompt_logprobs = None
    if body.prompt_logprobs is not None:  # vLLM's: once, beside the choices (they share the prompt)
        prompt_logprobs = prompt_logprobs_of(results[0].final.prompt_tokens, state.tokenizer.token_text)
    response = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage(jobs, [r.final for r in results]), prompt_logprobs=prompt_logprobs)
    return JSONResponse(response.model_dump(), headers=adapter_header(served.adapter))
