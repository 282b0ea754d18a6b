"""Error responses in the shapes each API's clients understand.

Native (LoRAX/TGI) routes: `{"error": "...", "error_type": "..."}` with 404 (adapter not found), 422
(validation, invalid adapter), 424 (generation failed), 429 (overloaded), 503 (unhealthy). OpenAI
routes (`/v1/...`): `{"error": {"message", "type", "param", "code"}}` with 400 (bad field, invalid
adapter), 404 (unknown model or adapter), 429 (overloaded), 500 (generation failed).
Every 429 carries `Retry-After` (whole seconds, >= 1; server/admission.py estimates it).
Before any route, in either shape: 401 (`--api-key`, server/auth.py), 404 / 405 (unknown path or method), 408
(a body that stopped arriving) and 413 (a body over `--max-request-bytes`, server/disconnects.py), 504 / 503 (past
`--request-timeout-s`, or a shutdown's deadline). Their OpenAI `type` is OpenAI's for the status (openai_error_type):
server_error for 5xx (the 504 included), invalid_request_error for 4xx, authentication_error for a 401. Every
refusal and failure is counted in `lorax_request_failure` (server/metrics.py says under which `err`).
Any other exception is a 500 in the route's shape naming the request id (the traceback goes to the log only).
"""

from __future__ import annotations

import logging

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.engine.requests.request import RequestRefused
from loraplex.lora.adapter import AdapterInvalid, AdapterNotFound
from loraplex.lora.errors import AdapterSourceUnavailable
from loraplex.server.validation import InputTooLong
from loraplex.multimodal import MediaError
from loraplex.server import request_log
from loraplex.server.admission import Overloaded
from loraplex.server.state import GenerationFailed

log = logging.getLogger("loraplex.server")


class ModelNotFound(LookupError):
    """An OpenAI `model` that this server does not serve."""


class BadRequest(ValueError):
    """A field the edge refuses; `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- the error responses as the OpenAPI document states them ---------------------------------------


class NativeErrorBody(BaseModel):
    error: str
    error_type: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


_WHY = {
    400: "a field the server refuses (OpenAI: any invalid request)",
    404: "unknown adapter or model",
    409: "an adapter name that is taken (run-time loads without load_inplace)",
    413: "request body or image too large",
    415: "image of a type the server does not read",
    422: "invalid request (native), or an image that cannot be read or fetched",
    424: "generation failed",
    429: "overloaded: too many requests at once",
    500: "generation failed, or an unexpected error (the message names the request id)",
    503: "unhealthy: the engine stopped or a forward pass fails",
}
# What a generation route may answer besides 200 (the middleware's 401 / 504 need --api-key / --request-timeout-s).
NATIVE_GENERATE_ERRORS = (404, 413, 415, 422, 424, 429)
OPENAI_GENERATE_ERRORS = (400, 404, 413, 415, 422, 429, 500)


def documented_errors(openai: bool, *codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each code with the API's error body. Listing 422 also replaces FastAPI's own
    422 entry (its `{"detail": [...]}` shape, which these routes never answer)."""
    model = OpenAIErrorBody if openai else NativeErrorBody
    return {code: {"model": model, "description": _WHY[code]} for code in codes}


def is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_for_path(path: str, status: int, message: str, kind: str, openai_type: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An error in the shape of the API `path` belongs to: LoRAX's (`error_type` = kind), or under /v1/ OpenAI's
    (`type` = openai_type, else OpenAI's for the status; `code` = code or kind). For the handlers and middleware
    that have no route's models."""
    if path.startswith("/v1/"):
        return openai_error(status, message, openai_type or openai_error_type(status), code=code or kind)
    return native_error(status, message, kind)


def openai_error_type(status: int) -> str:
    """OpenAI's error `type` for a status: the server's fault (5xx, a 504 timeout included) is a server_error,
    the request's (4xx) an invalid_request_error (a 401 names its own: authentication_error, server/auth.py)."""
    return "server_error" if status >= 500 else "invalid_request_error"


def _utf8(text: str | None) -> str | None:
    """Messages can quote the request (a dict key in an error's location): lone surrogates, escaped, so that
    the error itself can be encoded."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def native_error(status: int, message: str, error_type: str) -> JSONResponse:
    return JSONResponse({"error": _utf8(message), "error_type": error_type}, status_code=status)


def openai_error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": _utf8(message), "type": kind, "param": _utf8(param), "code": code}}
    return JSONResponse(body, status_code=status)


def error_response(request: Request, exc: Exception) -> JSONResponse:
    """The response for a known exception, in the shape of the route's API (and its failure counted)."""
    if not isinstance(exc, GenerationFailed):  # those are counted where they happen
        kind = {Overloaded: "overloaded", ModelNotFound: "not_found", AdapterNotFound: "not_found",
                AdapterSourceUnavailable: "unavailable"}.get(
            type(exc), "validation"
        )
        request.app.state.loraplex.metrics.on_failure(kind)
    openai = is_openai(request)
    if isinstance(exc, Overloaded):
        response = openai_error(429, str(exc), "rate_limit_error", code="overloaded") if openai else native_error(429, str(exc), "overloaded")
        response.headers["Retry-After"] = str(exc.retry_after)
        return response
    if isinstance(exc, (ModelNotFound, AdapterNotFound)):
        return openai_error(404, str(exc), "not_found_error", "model", "model_not_found") if openai else native_error(404, str(exc), "not_found")
    if isinstance(exc, AdapterSourceUnavailable):
        return openai_error(503, str(exc), "server_error", "model", "adapter_source_unavailable") if openai else native_error(503, str(exc), "unavailable")
    if isinstance(exc, AdapterInvalid):
        return openai_error(400, str(exc), "invalid_request_error", "model", "invalid_adapter") if openai else native_error(422, str(exc), "validation")
    if isinstance(exc, (RequestRefused, BadRequest, InputTooLong)):
        param = getattr(exc, "param", None)
        return openai_error(400, str(exc), "invalid_request_error", param) if openai else native_error(422, str(exc), "validation")
    if isinstance(exc, MediaError):  # an image the request named: its own status (400/413/415/422)
        return openai_error(exc.status, str(exc), "invalid_request_error", "messages") if openai else native_error(exc.status, str(exc), "validation")
    if isinstance(exc, GenerationFailed):
        return openai_error(500, str(exc), "server_error") if openai else native_error(424, str(exc), "generation")
    raise exc


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        request.app.state.loraplex.metrics.on_failure("validation")
        # The deepest error: of a union's branches (content: a string or parts), the one that got furthest.
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        if is_openai(request):
            return openai_error(400, message, "invalid_request_error", where or None)
        return native_error(422, message, "validation")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods (404, 405) in the route's API shape, not FastAPI's `{"detail": ...}`."""
        if exc.status_code == 400:  # FastAPI could not read the body (not UTF-8): refused as a body that is not JSON
            request.app.state.loraplex.metrics.on_failure("validation")
            message = f"body: {exc.detail}"
            if is_openai(request):
                return openai_error(400, message, "invalid_request_error", "body")
            return native_error(422, message, "validation")
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = error_for_path(request.url.path, exc.status_code, message, kind)
        for name, value in (exc.headers or {}).items():  # e.g. 405's Allow
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug: the client gets the API's error shape and the request id to report, the log the traceback.
        Starlette runs this outermost (outside RequestLog), so the record is also read from the scope."""
        record = request_log.current() or getattr(request.state, "log", None)
        request_id = record.request_id if record else "-"
        log.error("request_id=%s %s %s failed: %s", request_id, request.method, request.url.path,
                  type(exc).__name__, exc_info=exc)
        request.app.state.loraplex.metrics.on_failure("internal")
        message = f"internal server error; request id {request_id}"
        response = error_for_path(request.url.path, 500, message, "internal", "server_error", code="internal_error")
        response.headers["x-request-id"] = request_id
        return response

    for kind in (Overloaded, ModelNotFound, AdapterNotFound, AdapterSourceUnavailable, AdapterInvalid, RequestRefused,
                 BadRequest, InputTooLong, MediaError, GenerationFailed):
        app.add_exception_handler(kind, error_response)
