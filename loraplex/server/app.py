"""The FastAPI application: routes translate HTTP <-> engine calls and nothing more."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex import __version__
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import RequestOutput, RequestRefused
from loraplex.params import SamplingParams, TokenInfo
from loraplex.protocol.native import (
    Details, GenerateRequest, GenerateResponse, StreamDetails, StreamResponse, Token,
)


def _error(status: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status)


def create_app(engine: AsyncEngine) -> FastAPI:
    app = FastAPI(title="loraplex", version=__version__)
    core = engine.engine
    tokenizer = core.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(422, f"{where}: {first.get('msg')}", "validation")

    @app.exception_handler(RequestRefused)
    async def _refused(_: Request, exc: RequestRefused) -> JSONResponse:
        return _error(422, str(exc), "validation")

    def prepare(body: GenerateRequest) -> tuple[list[int], SamplingParams]:
        prompt_ids = tokenizer.encode(body.inputs)
        return prompt_ids, body.parameters.to_sampling_params()

    @app.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)
    async def generate(body: GenerateRequest):
        prompt_ids, params = prepare(body)
        tokens: list[TokenInfo] = []
        final: RequestOutput | None = None
        try:
            async for out in engine.generate(prompt_ids, params):
                if out.token is not None:
                    tokens.append(out.token)
                final = out
        except RequestRefused as exc:
            return _error(422, str(exc), "validation")
        except RuntimeError as exc:
            return _error(424, str(exc), "generation")
        assert final is not None and final.finished
        details = None
        if body.parameters.details:
            details = Details(
                finish_reason=final.finish_reason.value,
                prompt_tokens=final.num_prompt_tokens,
                generated_tokens=final.num_generated_tokens,
                seed=final.seed if not params.greedy else None,
                prefill=[Token.of(t) for t in final.prompt_tokens or []],
                tokens=[Token.of(t) for t in tokens],
            )
        return GenerateResponse(generated_text=final.generated_text, details=details)

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest):
        prompt_ids, params = prepare(body)
        outputs = engine.generate(prompt_ids, params)
        try:  # refusals surface before the first byte, as a plain error response
            first = await anext(outputs)
        except RequestRefused as exc:
            return _error(422, str(exc), "validation")
        except RuntimeError as exc:
            return _error(424, str(exc), "generation")

        async def events() -> AsyncIterator[str]:
            out = first
            try:
                while True:
                    yield _sse(_stream_event(out, params))
                    if out.finished:
                        return
                    out = await anext(outputs)
            except RuntimeError as exc:
                yield _sse({"error": str(exc), "error_type": "generation"})
            finally:
                await outputs.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    probe_prompt = [core.model_config.bos_token_id or 0]

    @app.get("/health")
    async def health():
        try:  # healthy means a forward pass works right now
            async for _ in engine.generate(probe_prompt, SamplingParams(max_new_tokens=1)):
                pass
        except Exception as exc:  # noqa: BLE001 — any failure means unhealthy
            return _error(503, f"unhealthy: {exc}", "unhealthy")
        return JSONResponse({}, status_code=200)

    @app.get("/info")
    async def info():
        return {
            "model_id": core.model_id,
            "model_dtype": str(core.dtype).removeprefix("torch."),
            "model_device_type": core.device.type,
            "max_input_length": core.max_total_tokens - 1,
            "max_total_tokens": core.max_total_tokens,
            "max_batch_total_tokens": core.kv_capacity_tokens,
            "max_batch_prefill_tokens": core.config.max_batch_prefill_tokens,
            "block_size": core.config.block_size,
            "version": __version__,
        }

    return app


def _stream_event(out: RequestOutput, params: SamplingParams) -> dict:
    event = StreamResponse(token=Token.of(out.token))
    if out.finished:
        event.generated_text = out.generated_text
        event.details = StreamDetails(
            finish_reason=out.finish_reason.value,
            prompt_tokens=out.num_prompt_tokens,
            generated_tokens=out.num_generated_tokens,
            seed=out.seed if not params.greedy else None,
        )
    return event.model_dump()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
