"""Embeddings: OpenAI's `POST /v1/embeddings` and LoRAX's `POST /embed` (protocol/embeddings.py).

Each input becomes one engine request that pools its prompt's final hidden rows (SamplingParams.pooling,
engine/worker/pooling.py) instead of sampling: it runs in the same steps as generation, with the request's adapter,
and takes one seat of --max-concurrent-requests while it runs (the inputs of one request are bounded by
--max-sequences-per-request, as its sequences are). Inputs are bounded as prompts are (--max-input-length, in
characters before tokenizing and in tokens after).
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplex.lora.adapter import LoraAdapter
from loraplex.params import Pooling, SamplingParams
from loraplex.protocol.embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    EmbedRequest,
    EmbedResponse,
    encoded,
)
from loraplex.server.admission import sequences_per_request
from loraplex.server.counted_route import CountedRoute
from loraplex.server.errors import BadRequest, documented_errors
from loraplex.server.limits import check_prompt_and_budget
from loraplex.server.native import merge_spec
from loraplex.server.openai_routes import all_or_none, resolve_model
from loraplex.server.request_log import note_adapter
from loraplex.server.state import Finished, ServerState, adapter_header, get_state, run_to_end

router = APIRouter(route_class=CountedRoute)  # bodies parsed and counted off the loop

FLAG_METHODS = {"cls": "first"}  # --pooling's names (sentence-transformers') for Pooling's methods


def pooling_of(state: ServerState, param: str) -> tuple[Pooling, str]:
    """How this server pools, and the prompt put before each text: --pooling, else the checkpoint's
    sentence-transformers configuration, else the last token's state, L2-normalised (checkpoints/pooling_config.py)."""
    model = state.model.pooling
    if state.config.pooling is not None:
        return Pooling(FLAG_METHODS.get(state.config.pooling, state.config.pooling), model.pooling.normalize), model.prompt
    if model.refusal is not None:
        raise BadRequest(f"this model's embeddings cannot be served as it defines them: {model.refusal} (--pooling "
                         "picks one)", param)
    return model.pooling, model.prompt


async def prompt_ids(state: ServerState, item: str | list[int], param: str, prefix: str = "") -> list[int]:
    """One input's token ids: a text (after `prefix`, the checkpoint's prompt) tokenized off the loop (bounded in
    characters first), or ids checked against the vocabulary; bounded by --max-input-length."""
    if isinstance(item, str):
        state.validation.check_length(prefix + item, param)
        ids = await state.validation.run(state.tokenizer.encode, prefix + item, add_special_tokens=True)
    else:
        vocab = state.tokenizer.vocab_size
        if any(not 0 <= token < vocab for token in item):
            raise BadRequest(f"{param} token ids must be in [0, {vocab})", param)
        ids = item
    check_prompt_and_budget(state, ids, 1, param, param)
    return ids


async def embed_all(state: ServerState, inputs: list[list[int]], adapter: LoraAdapter | None,
                    pooling: Pooling) -> list[Finished]:
    """Every input's pooled vector, its requests run at once (a seat each: all or none)."""
    params = SamplingParams(max_new_tokens=1, pooling=pooling)
    seats = state.admit_all([(len(ids), 1) for ids in inputs])
    try:
        return await all_or_none([run_to_end(state, ids, params, adapter, None, seat)
                                   for ids, seat in zip(inputs, seats)])
    finally:  # each run gives its seat back as it ends; these are the runs cancelled before they began
        state.release_all(seats)


def shortened(vector: list[float], dimensions: int | None, hidden: int) -> list[float]:
    """The first `dimensions` values, normalised again (OpenAI's `dimensions`); 400 past the model's width."""
    if dimensions is None:
        return vector
    if dimensions > hidden:
        raise BadRequest(f"dimensions must be <= {hidden} (the model's embedding size); got {dimensions}", "dimensions")
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


@router.post("/v1/embeddings", responses=documented_errors(True, 400, 404, 413, 429))
async def embeddings(body: EmbeddingRequest, request: Request):
    state = get_state(request)
    pooling, prefix = pooling_of(state, "input")
    items = body.inputs()
    if not items or any(not item for item in items):
        raise BadRequest("input must not be empty (nor hold an empty text or list)", "input")
    share = sequences_per_request(state.config.max_concurrent_requests, state.config.max_sequences_per_request)
    if len(items) > share:
        raise BadRequest(f"input may hold at most {share} inputs (--max-sequences-per-request); got {len(items)}",
                         "input")
    inputs = [await prompt_ids(state, item, "input", prefix) for item in items]
    served = await resolve_model(state, body)
    results = await embed_all(state, inputs, served.adapter, pooling)
    data = [EmbeddingData(embedding=encoded(shortened(r.final.embedding, body.dimensions, len(r.final.embedding)),
                                            body.encoding_format), index=i) for i, r in enumerate(results)]
    tokens = sum(len(ids) for ids in inputs)
    state.metrics.on_embeddings("/v1/embeddings", len(inputs), tokens)
    response = EmbeddingResponse(data=data, model=served.name, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                                    total_tokens=tokens))
    return JSONResponse(response.model_dump(), headers=adapter_header(served.adapter))


@router.post("/embed", responses=documented_errors(False, 404, 413, 422, 429))
async def embed(body: EmbedRequest, request: Request):
    """LoRAX's route: one text's vector, on the adapter its parameters name."""
    state = get_state(request)
    pooling, prefix = pooling_of(state, "inputs")
    if not body.inputs:
        raise BadRequest("inputs must not be empty", "inputs")
    p = body.parameters
    if p.adapter_id and p.merged_adapters:
        raise BadRequest("give adapter_id or merged_adapters, not both", "merged_adapters")
    ids = await prompt_ids(state, body.inputs, "inputs", prefix)
    note_adapter(p.adapter_id, p.merged_adapters.ids if p.merged_adapters else ())
    adapter_id = p.adapter_id or (state.config.default_adapter_id if not p.merged_adapters else None)
    adapter = await state.adapter(adapter_id, p.adapter_source, merge_spec(p.merged_adapters), p.api_token)
    (result,) = await embed_all(state, [ids], adapter, pooling)
    state.metrics.on_embeddings("/embed", 1, len(ids))
    return JSONResponse(EmbedResponse(embeddings=result.final.embedding).model_dump(), headers=adapter_header(adapter))
