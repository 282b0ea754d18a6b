"""vLLM's utility routes beside the OpenAI API: `GET /version`, `POST /detokenize`, and vLLM's two bodies of
`POST /tokenize` (the route is TGI's too: server/native.py reads its body and hands vLLM's here). Outside /v1/ their
errors take the native shape, as every such route's do."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from loraplex import __version__
from loraplex.engine.requests.inputs import PromptTooLong
from loraplex.protocol.base import RequestModel
from loraplex.protocol.vllm import DetokenizeRequest, TokenizeBody, TokenizeChatRequest, TokenizeCompletionRequest
from loraplex.server.errors import BadRequest, ModelNotFound, documented_errors
from loraplex.server import openai_inputs
from loraplex.server.openai_inputs import refusing
from loraplex.server.state import ServerState, get_state

router = APIRouter()


def check_model(state: ServerState, model: str | None) -> None:
    """vLLM's `model`: a served name or a named, preloaded or loaded adapter (the text is the base tokenizer's)."""
    if model and model not in (*state.base_names, *state.adapters.loaded_ids()):
        raise ModelNotFound(f"The model `{model}` does not exist.")


@router.get("/version", summary="The server's version (vLLM's route)")
async def version():
    return {"version": __version__}


@router.post("/detokenize", responses=documented_errors(False, 404, 413, 422, 429),
             summary="Token ids to text (vLLM's route)")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = get_state(request)
    check_model(state, body.model)
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


# ---- POST /tokenize, vLLM's bodies -----------------------------------------------------------------


def tokenize_body(body: TokenizeBody) -> RequestModel:
    """The body as the one shape it gives (TGI's, vLLM's completion or chat body): two of them, none, or a field
    of another one is a 422 naming them; a field the shape refuses, the 422 FastAPI's validation would give."""
    model = refusing(body.shape)
    try:
        return model.model_validate(body.root)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def check_prompt_length(state: ServerState, num_tokens: int, param: str) -> None:
    """At most --max-input-length tokens, refused as the generation routes refuse it (an empty prompt is 0 tokens
    here: nothing is generated from it)."""
    try:
        if num_tokens:
            state.model.limits.check_prompt(num_tokens)
    except PromptTooLong as refused:
        raise BadRequest(f"{param} must have at most {refused.limit} tokens (max input length); got "
                         f"{refused.num_tokens}", param) from None


async def chat_ids(state: ServerState, body: TokenizeChatRequest) -> list[int]:
    """The ids /v1/chat/completions gives the engine for these messages (server/openai_inputs.py prepare_chat:
    the same template and tools, image placeholders expanded as the processor expands them), with vLLM's
    add_generation_prompt and continue_final_message."""
    refusing(body.check)
    ids, _ = await openai_inputs.chat_ids(state, refusing(body.template_messages), refusing(body.tool_plan),
                                          body.add_special_tokens, body.add_generation_prompt, body.continue_final_message)
    return ids


async def tokenize_vllm(state: ServerState, body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
    """vLLM's answer: {count, max_model_len (the server's --max-total-tokens), tokens, token_strs (the tokens'
    vocabulary strings when asked, else null)}; on the token routes' workers (full: 429)."""
    check_model(state, body.model)
    validation, tokenizer = state.validation, state.tokenizer
    with validation.token_routes():
        if isinstance(body, TokenizeCompletionRequest):  # as /v1/completions reads a text prompt
            param = "prompt"
            validation.check_length(body.prompt, param)
            ids = await validation.run(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            param = "messages"
            ids = await chat_ids(state, body)
        check_prompt_length(state, len(ids), param)

        def answer() -> bytes:  # on a worker: the strings and the JSON are O(tokens)
            strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
            shown = {"count": len(ids), "max_model_len": state.model.max_total_tokens, "tokens": ids, "token_strs": strs}
            return json.dumps(shown, ensure_ascii=False, separators=(",", ":")).encode()

        return Response(await validation.run(answer), media_type="application/json")
