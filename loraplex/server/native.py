"""LoRAX/TGI-native routes: /generate, /generate_stream, POST /, /tokenize, /info, /health."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex import __version__
from loraplex.engine.requests.output import RequestOutput
from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.sources.store import MergeSpec
from loraplex.params import SamplingParams
from loraplex.protocol.native import (
    BestOfSequence,
    CompatGenerateRequest,
    Details,
    GenerateRequest,
    GenerateResponse,
    MergedAdapters,
    StreamDetails,
    StreamResponse,
    Token,
    TokenizeRequest,
)
from loraplex.protocol.vllm import TokenizeBody
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.multimodal import split_markdown_images
from loraplex.protocol.errors import Unsupported
from loraplex.server.admission import sequences_per_request
from loraplex.server.docs import EVENTS, JSON_OR_EVENTS
from loraplex.server.errors import NATIVE_GENERATE_ERRORS, BadRequest, documented_errors, native_error
from loraplex.server.grammars import compile_grammars
from loraplex.server.images import encode_prompt, image_placeholder
from loraplex.server.counted_route import CountedRoute
from loraplex.server.limits import check_prompt_and_budget, check_stop_sequences
from loraplex.server.request_log import note_adapter
from loraplex.server.state import GenerationFailed, ServerState, adapter_header, get_state, run_to_end
from loraplex.server.vllm_routes import tokenize_body, tokenize_vllm

router = APIRouter(route_class=CountedRoute)  # bodies parsed and counted off the loop
ERRORS = documented_errors(False, *NATIVE_GENERATE_ERRORS)


@dataclass(frozen=True)
class Shown:
    """How many alternatives each field shows per generated token (the engine reports the larger count)."""

    alternatives: int = 0  # LoRAX's return_k_alternatives: each token's alternative_tokens
    top_tokens: int = 0  # TGI's top_n_tokens: details.top_tokens, a stream event's top_tokens

    @classmethod
    def asked(cls, body: GenerateRequest) -> "Shown":
        return cls(body.parameters.return_k_alternatives or 0, body.parameters.top_n_tokens or 0)

    def tokens(self, infos) -> list[Token]:
        return [Token.of(t, self.alternatives) for t in infos]

    def top(self, infos) -> list[list[Token]] | None:
        return [Token.top(t, self.top_tokens) for t in infos] if self.top_tokens else None


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    prefix: str  # prepended to generated_text (return_full_text)
    validated_at: float
    input_characters: int  # of `inputs` as sent (LoRAX's x-compute-characters)
    adapter: LoraAdapter | None = None
    images: ImageInputs | None = None


async def prepare(state: ServerState, body: GenerateRequest) -> Prepared:
    """Validate a native request against the server's limits and turn it into engine inputs.

    The adapter is loaded last, so a request with bad parameters never triggers a load.
    """
    started = time.perf_counter()
    p = body.parameters
    note_adapter(p.adapter_id, p.merged_adapters.ids if p.merged_adapters else ())  # for its log line and metrics
    limits = state.config
    if p.adapter_id and p.merged_adapters:
        raise BadRequest("give adapter_id or merged_adapters, not both", "merged_adapters")
    try:
        constraint = p.output_constraint()
    except Unsupported as exc:
        raise BadRequest(str(exc), exc.param) from exc
    check_stop_sequences(state, len(p.stop))
    best_of = p.best_of or 1
    if best_of > limits.max_best_of:
        raise BadRequest(f"best_of must be <= {limits.max_best_of} (max best of); got {best_of}")
    share = sequences_per_request(limits.max_concurrent_requests, limits.max_sequences_per_request)
    if best_of > share:  # each sequence takes a seat: one request may not take every seat (issue 58)
        raise BadRequest(
            f"best_of must be <= {share} (--max-sequences-per-request; by default a quarter of "
            f"--max-concurrent-requests {limits.max_concurrent_requests}, so that one request leaves seats for the "
            f"others); got {best_of}",
            "best_of",
        )
    if best_of > 1 and not (p.do_sample or p.temperature or p.top_k or p.top_p or p.typical_p):
        raise BadRequest("best_of > 1 needs sampling: set do_sample or a sampling parameter")
    if best_of > 1 and p.seed is not None:
        raise BadRequest("best_of > 1 cannot be combined with a seed (each sequence needs its own)")
    text = body.inputs
    if p.apply_chat_template:
        try:
            text = await state.validation.run(state.tokenizer.apply_chat_template, body.chat_messages())
        except Exception as exc:  # no template, or the template refused these messages
            raise BadRequest(f"inputs cannot be turned into a chat prompt: {exc}", "apply_chat_template") from exc
    # LoRAX's image form: ![](URL) in the text, each replaced by the model's image placeholder.
    text, urls = split_markdown_images(text, image_placeholder(state))
    prompt_ids, images = await encode_prompt(state, text, urls, not p.apply_chat_template, "inputs")
    if p.truncate is not None and p.truncate < len(prompt_ids):
        if images is not None and images.positions[0] < len(prompt_ids) - p.truncate:
            raise BadRequest(f"truncate={p.truncate} would cut an image's tokens out of the prompt", "truncate")
        prompt_ids = prompt_ids[-p.truncate :]
        if images is not None:
            images = images.for_ids(prompt_ids)
    max_new = p.max_new_tokens or limits.default_max_new_tokens
    check_prompt_and_budget(state, prompt_ids, max_new, "inputs", "max_new_tokens")
    prefix = body.inputs if p.return_full_text else ""
    await compile_grammars(state, [constraint])
    params = p.to_sampling_params(max_new)
    adapter_id = p.adapter_id or (state.config.default_adapter_id if not p.merged_adapters else None)
    adapter = await state.adapter(adapter_id, p.adapter_source, merge_spec(p.merged_adapters), p.api_token)
    return Prepared(prompt_ids, params, prefix, time.perf_counter() - started, len(body.inputs), adapter, images)


def merge_spec(merged: MergedAdapters | None) -> MergeSpec | None:
    if merged is None:
        return None
    return MergeSpec(
        tuple(merged.ids), tuple(merged.weights), merged.merge_strategy or "linear", merged.density,
        merged.majority_sign_method or "total",
    )


def headers(state: ServerState, prepared: Prepared, final: RequestOutput, started: float) -> dict[str, str]:
    t = final.timings
    total = time.perf_counter() - started
    inference = t.get("total", 0.0) - t.get("queue", 0.0)
    per_token = inference / max(1, final.num_generated_tokens)
    ms = lambda seconds: str(int(seconds * 1000))  # noqa: E731
    return {
        "x-compute-type": state.model.device_type,
        "x-compute-time": ms(total),
        "x-compute-characters": str(prepared.input_characters),
        "x-total-time": ms(total),
        "x-validation-time": ms(prepared.validated_at),
        "x-queue-time": ms(t.get("queue", 0.0)),
        "x-inference-time": ms(inference),
        "x-time-per-token": ms(per_token),
        "x-prompt-tokens": str(final.num_prompt_tokens),
        "x-generated-tokens": str(final.num_generated_tokens),
        "x-total-tokens": str(final.num_prompt_tokens + final.num_generated_tokens),
        "x-model-id": state.model_id,
        **adapter_header(prepared.adapter),
    }



ENCODER_PREFILL_NOTE = (
    "prefill logprobs are not defined for an encoder-decoder model: its input is encoded, not predicted"
)


def sampled_seed(params: SamplingParams, seed: int | None) -> int | None:
    return None if params.greedy else seed


async def generate_json(state: ServerState, body: GenerateRequest) -> JSONResponse:
    started = time.perf_counter()
    prepared = await prepare(state, body)
    best_of = body.parameters.best_of or 1
    # The best_of sequences admitted at once (a seat each, all or none); each run gives its seat back as it ends.
    seats = state.admit_all([(len(prepared.prompt_ids), prepared.params.max_new_tokens)] * best_of)
    tasks = [
        asyncio.ensure_future(run_to_end(state, prepared.prompt_ids, prepared.params, prepared.adapter,
                                         prepared.images, seat))
        for seat in seats
    ]
    try:
        runs = await asyncio.gather(*tasks)
    finally:  # one failed (or the client went away): none runs on, and no seat stays taken
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        state.release_all(seats)
    best = max(runs, key=lambda r: r.logprob_sum)
    final = best.final
    details = None
    if body.parameters.details:
        asked_prefill = body.parameters.decoder_input_details
        shown = Shown.asked(body)
        prefill = [Token.of(t) for t in final.prompt_tokens or []]  # as TGI: prompt tokens have no top tokens
        others = [
            BestOfSequence(
                generated_text=prepared.prefix + r.final.generated_text, finish_reason=r.final.finish_reason.value,
                generated_tokens=r.final.num_generated_tokens, seed=sampled_seed(prepared.params, r.final.seed),
                prefill=prefill, tokens=shown.tokens(r.tokens), top_tokens=shown.top(r.tokens),
            )
            for r in runs if r is not best
        ]
        details = Details(
            finish_reason=final.finish_reason.value, prompt_tokens=final.num_prompt_tokens,
            generated_tokens=final.num_generated_tokens, seed=sampled_seed(prepared.params, final.seed),
            prefill=prefill, tokens=shown.tokens(best.tokens), top_tokens=shown.top(best.tokens),
            best_of_sequences=others or None,
            prefill_note=ENCODER_PREFILL_NOTE if asked_prefill and state.model.is_encoder_decoder else None,
        )
    response = GenerateResponse(generated_text=prepared.prefix + final.generated_text, details=details)
    return JSONResponse(_prune(response.model_dump()), headers=headers(state, prepared, final, started))


async def generate_sse(state: ServerState, body: GenerateRequest):
    if (body.parameters.best_of or 1) > 1:
        raise BadRequest("best_of > 1 is not supported when streaming", "best_of")
    prepared = await prepare(state, body)
    outputs = state.generate(prepared.prompt_ids, prepared.params, prepared.adapter, prepared.images)
    first = await anext(outputs)  # refusals surface here, before any byte, as a plain error response
    shown = Shown.asked(body)

    async def events() -> AsyncIterator[str]:
        out = first
        try:
            while True:
                event = StreamResponse(token=Token.of(out.token, shown.alternatives),
                                       top_tokens=Token.top(out.token, shown.top_tokens) if shown.top_tokens else None)
                if out.finished:
                    event.generated_text = prepared.prefix + out.generated_text
                    event.details = StreamDetails(
                        finish_reason=out.finish_reason.value, prompt_tokens=out.num_prompt_tokens,
                        generated_tokens=out.num_generated_tokens, seed=sampled_seed(prepared.params, out.seed),
                    )
                # allow_nan=False: a NaN must fail loudly, never go out as a literal the client cannot parse
                event_json = json.dumps(_prune(event.model_dump(), keep=("generated_text", "details")), allow_nan=False)
                yield f"data: {event_json}\n\n"
                if out.finished:
                    return
                out = await anext(outputs)
        except GenerationFailed as exc:
            yield f"data: {json.dumps({'error': str(exc), 'error_type': 'generation'})}\n\n"
        finally:
            await outputs.aclose()  # a client that went away aborts its request here

    headers = {"x-model-id": state.model_id, **adapter_header(prepared.adapter)}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


_OPTIONAL = ("details", "best_of_sequences", "alternative_tokens", "top_tokens", "generated_text")


def _prune(value, keep: tuple[str, ...] = ()):
    """Drop optional fields that are None, as LoRAX omits them; `logprob: null` (first prefill token) stays,
    and so do the fields in `keep` (TGI streams explicit nulls for generated_text and details)."""
    if isinstance(value, dict):
        return {
            k: _prune(v) for k, v in value.items() if not (v is None and k in _OPTIONAL and k not in keep)
        }
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


@router.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True, responses=ERRORS)
async def generate(body: GenerateRequest, request: Request):
    return await generate_json(get_state(request), body)


@router.post("/generate_stream", response_class=Response, responses={**EVENTS, **ERRORS})
async def generate_stream(body: GenerateRequest, request: Request):
    return await generate_sse(get_state(request), body)


@router.post("/", summary="generate or generate_stream, by the `stream` field", responses={**JSON_OR_EVENTS, **ERRORS})
async def compat_generate(body: CompatGenerateRequest, request: Request):
    state = get_state(request)
    if body.stream:
        return await generate_sse(state, body)
    response = await generate_json(state, body)
    response.body = b"[" + response.body + b"]"
    response.headers["content-length"] = str(len(response.body))
    return response


@router.post("/invocations", summary="SageMaker's route (TGI's): as POST /", responses={**JSON_OR_EVENTS, **ERRORS})
async def invocations(body: CompatGenerateRequest, request: Request):
    return await compat_generate(body, request)


TOKENIZE_ANSWERS = {200: {"description": "TGI's body: a list of {id, text, start, stop}; vLLM's bodies: {count, "
                                          "max_model_len, tokens, token_strs}"}}


@router.post("/tokenize", responses={**TOKENIZE_ANSWERS, **documented_errors(False, 404, 413, 415, 422, 429)},
             summary="Text or chat messages to tokens (TGI's body, or vLLM's completion and chat bodies)")
async def tokenize(raw: TokenizeBody, request: Request):
    # The tokens of `inputs`, at most --max-input-length of them (more: 422 naming the limit, refused before any
    # work per token, so the answer stays bounded); on the token routes' workers, never generation's (a full pool:
    # 429 + Retry-After). vLLM's bodies (prompt, messages) are answered in vLLM's shape (server/vllm_routes.py).
    state = get_state(request)
    body = tokenize_body(raw)
    if not isinstance(body, TokenizeRequest):
        return await tokenize_vllm(state, body)
    tokenizer, validation = state.tokenizer, state.validation
    with validation.token_routes():
        text, urls = split_markdown_images(body.inputs, image_placeholder(state))
        validation.check_length(text, "inputs")  # the text the tokenizer reads: an image's URL is not in it
        if urls:  # each image's placeholder tokens, as many as the request would use (no character offsets)
            ids, _ = await encode_prompt(state, text, urls, body.add_special_tokens, "inputs")
            validation.check_tokens(len(ids), "inputs")
            offsets = [(0, 0)] * len(ids)
        else:
            ids, offsets = None, None

        def answer() -> bytes:  # on a worker: the tokens, one dict each, and their JSON are O(input)
            found, spans = (ids, offsets) if ids is not None else _encode_with_offsets(tokenizer, validation, body)
            tokens = [{"id": i, "text": tokenizer.token_text(i), "start": start, "stop": stop}
                      for i, (start, stop) in zip(found, spans)]
            return json.dumps(tokens, ensure_ascii=False, separators=(",", ":")).encode()

        return Response(await validation.run(answer), media_type="application/json")


def _encode_with_offsets(tokenizer, validation, body: TokenizeRequest) -> tuple[list[int], list]:
    """The ids and their character spans; past --max-input-length refused as soon as the ids are known."""
    ids = tokenizer.encode(body.inputs, add_special_tokens=body.add_special_tokens)
    validation.check_tokens(len(ids), "inputs")
    encoding = tokenizer.hf(body.inputs, add_special_tokens=body.add_special_tokens, return_offsets_mapping=True)
    return ids, encoding.get("offset_mapping") or [(0, 0)] * len(ids)


# /health answers at once when the engine completed a step this recently; otherwise it runs a one-token probe.
HEALTH_RECENT_STEP_S = 5.0


@router.get("/health", responses=documented_errors(False, 503))
@router.head("/health", include_in_schema=False)
async def health(request: Request):
    state = get_state(request)
    if not state.engine.alive:
        return native_error(503, f"unhealthy: the engine stopped ({state.engine.died!r})", "unhealthy")
    if state.engine.stepped_within(HEALTH_RECENT_STEP_S):  # busy and working: a probe would only queue behind
        return JSONResponse({}, status_code=200)
    probe = [state.model.bos_token_id or 0]
    try:  # healthy means a forward pass works right now (straight to the engine: no slot, no metrics)
        async for _ in state.engine.generate(probe, SamplingParams(max_new_tokens=1)):
            pass
    except Exception as exc:  # noqa: BLE001 — any failure means unhealthy
        return native_error(503, f"unhealthy: {exc}", "unhealthy")
    return JSONResponse({}, status_code=200)


@router.get("/ping", summary="SageMaker's health route (TGI's): as GET /health", responses=documented_errors(False, 503))
@router.head("/ping", include_in_schema=False)
async def ping(request: Request):
    return await health(request)


def embedding_info(state) -> dict:
    """The pooling the embedding routes use (--pooling, else the checkpoint's), or why they refuse."""
    pooling = state.model.pooling
    method = state.config.pooling or pooling.pooling.method
    served = state.config.pooling is not None or pooling.refusal is None
    return {"pooling": {"first": "cls"}.get(method, method), "normalize": pooling.pooling.normalize,
            "prompt": pooling.prompt, "from": "--pooling" if state.config.pooling else pooling.source,
            "refused": None if served else pooling.refusal}


@router.get("/info")
async def info(request: Request):
    state = get_state(request)
    model, settings = state.model, state.model.settings
    return {
        "model_id": model.model_id,
        "model_dtype": model.dtype,
        "model_device_type": model.device_type,
        "max_concurrent_requests": state.config.max_concurrent_requests,
        "max_queued_tokens": state.config.max_queued_tokens,  # null: off
        "max_best_of": state.config.max_best_of,
        "max_stop_sequences": state.config.max_stop_sequences,
        "max_input_length": model.max_input_length,
        "max_total_tokens": model.max_total_tokens,
        "max_batch_total_tokens": model.kv_capacity_tokens,
        "max_batch_prefill_tokens": settings.max_batch_prefill_tokens,
        "block_size": settings.block_size,
        "kv_cache_dtype": model.kv_cache_dtype,  # float8_e4m3fn under --kv-cache-dtype fp8
        "input_modalities": ["text", "image"] if model.takes_images else ["text"],
        "model_type": model.model_type,
        "quantize": settings.quantize,
        "speculate": settings.speculative_tokens,  # LoRAX's and TGI's name for the drafts per step
        "prefix_caching": settings.prefix_caching,
        "is_encoder_decoder": model.is_encoder_decoder,
        "embeddings": embedding_info(state),  # how /v1/embeddings and /embed pool (server/embeddings.py)
        "served_model_names": list(state.config.served_model_name or (state.model_id,)),
        "adapters": sorted(state.adapters.loaded_ids()),  # named, preloaded and loaded ones (as /v1/models)
        "default_adapter_id": state.config.default_adapter_id,
        "version": __version__,
        # LoRAX's fields that its clients read: what we know, else its defaults or null (not a build from git).
        "model_sha": settings.revision,
        "model_pipeline_tag": "text-generation",
        "max_waiting_tokens": settings.max_waiting_tokens,
        "waiting_served_ratio": settings.waiting_served_ratio,
        "validation_workers": state.config.validation_workers,
        "sha": None,
        "docker_label": os.environ.get("DOCKER_LABEL"),
    }
