"""Adapters loaded and unloaded while the server runs (`--allow-runtime-lora-updating`): vLLM's
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, and SGLang's `/load_lora_adapter` and
`/unload_lora_adapter` (same bodies). Errors come in OpenAI's shape on all four.

A load reads, checks and packs the adapter before it answers: a 200 means requests can use the name. An unload stops
new requests for the name at once; running ones finish with the weights they started with, then the engine frees
the adapter's slot (`AsyncEngine.retire_adapter`). `load_inplace` does the same to the adapter it replaces.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplex.lora.adapter import AdapterInvalid, AdapterNotFound
from loraplex.lora.errors import AdapterNameTaken, AdapterSourceUnavailable
from loraplex.protocol.adapters import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from loraplex.server.errors import documented_errors, openai_error
from loraplex.server.state import ServerState, get_state

router = APIRouter()
log = logging.getLogger("loraplex.server")

OFF = ("run-time adapter loading is off: start the server with --allow-runtime-lora-updating "
       "(or ALLOW_RUNTIME_LORA_UPDATING=1)")


@router.post("/v1/load_lora_adapter", responses=documented_errors(True, 400, 404, 409, 503), tags=["adapters"],
             summary="Load an adapter under a name (vLLM's route; --allow-runtime-lora-updating)")
@router.post("/load_lora_adapter", include_in_schema=False)  # SGLang's
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    state = get_state(request)
    if not state.config.allow_runtime_lora_updating:
        return _off()
    name = body.lora_name
    most = state.model.settings.max_active_adapters - 1  # one slot always rotates
    pinned = [n for n, named in state.adapters.named.all().items() if named.pinned and n != name]
    if body.pinned and len(pinned) >= most:
        return _refused(state, "load", 400, f"at most {most} adapters may be pinned (--max-active-adapters - 1); "
                        f"pinned now: {', '.join(sorted(pinned)) or 'none'}", "pinned", "too_many_pinned")
    try:
        adapter, replaced = await asyncio.to_thread(
            state.adapters.register, name, body.lora_path, body.load_inplace, body.pinned
        )
    except AdapterNameTaken as exc:
        return _refused(state, "load", 409, str(exc), "lora_name", "adapter_name_taken")
    except AdapterSourceUnavailable as exc:
        return _refused(state, "load", 503, str(exc), "lora_path", "adapter_source_unavailable")
    except (AdapterInvalid, AdapterNotFound) as exc:  # the existing checks' reason, naming the adapter by its name
        return _refused(state, "load", 400, str(exc), "lora_path", "invalid_adapter")
    if replaced is not None and replaced.key != adapter.key:
        state.engine.retire_adapter(replaced.key)
    if body.pinned:
        state.engine.hold_adapter(adapter.key)
    state.metrics.on_adapter_admin("load", "replaced" if replaced is not None else "loaded")
    log.info("adapter %r %s from %s", name, "replaced" if replaced is not None else "loaded", body.lora_path)
    return JSONResponse({"success": True, "lora_name": name,
                         "message": f"adapter {name!r} {'replaced' if replaced is not None else 'loaded'}",
                         "loaded_adapters": sorted(state.adapters.named.all())})


@router.post("/v1/unload_lora_adapter", responses=documented_errors(True, 400, 404), tags=["adapters"],
             summary="Stop serving an adapter name (vLLM's route; --allow-runtime-lora-updating)")
@router.post("/unload_lora_adapter", include_in_schema=False)  # SGLang's
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    state = get_state(request)
    if not state.config.allow_runtime_lora_updating:
        return _off()
    try:
        adapter = state.adapters.unregister(body.lora_name)
    except AdapterNotFound as exc:
        return _refused(state, "unload", 404, str(exc), "lora_name", "adapter_not_found")
    state.engine.retire_adapter(adapter.key)  # its slot is freed once the requests running on it end
    state.metrics.on_adapter_admin("unload", "unloaded")
    log.info("adapter %r unloaded", body.lora_name)
    return JSONResponse({"success": True, "lora_name": body.lora_name, "message": f"adapter {body.lora_name!r} unloaded",
                         "loaded_adapters": sorted(state.adapters.named.all())})


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 503: "server_error"}


def _off() -> JSONResponse:
    return openai_error(404, OFF, "not_found_error", code="runtime_lora_updating_off")


def _refused(state: ServerState, action: str, status: int, message: str, param: str, code: str) -> JSONResponse:
    state.metrics.on_adapter_admin(action, "refused")
    log.info("adapter %s refused: %s", action, message)
    return openai_error(status, message, _ERROR_TYPES[status], param, code)
