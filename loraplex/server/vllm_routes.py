"""vLLM's utility routes beside the OpenAI API: `GET /version` and `POST /detokenize` (vLLM's bodies; outside
/v1/ their errors take the native shape, as every such route's do)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex import __version__
from loraplex.protocol.vllm import DetokenizeRequest
from loraplex.server.errors import BadRequest, ModelNotFound, documented_errors
from loraplex.server.state import get_state

router = APIRouter()


@router.get("/version", summary="The server's version (vLLM's route)")
async def version():
    return {"version": __version__}


@router.post("/detokenize", responses=documented_errors(False, 404, 413, 422, 429),
             summary="Token ids to text (vLLM's route)")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = get_state(request)
    if body.model and body.model not in (*state.base_names, *state.adapters.loaded_ids()):
        raise ModelNotFound(f"The model `{body.model}` does not exist.")
    # A sequence (prompt and generated tokens) has at most --max-total-tokens: more is refused before any decoding.
    state.validation.check_tokens(len(body.tokens), "tokens", state.model.max_total_tokens, "max total tokens")
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", "tokens")
    # Off the event loop, on the token routes' workers (not generation's; full: 429): a long list takes the
    # tokenizer a while. Special tokens kept, as vLLM's answer does.
    with state.validation.token_routes():
        prompt = await state.validation.run(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": prompt}
