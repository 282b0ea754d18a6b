"""The FastAPI application: assembles the route modules over one shared ServerState."""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response

from loraplex import __version__
from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.stats import AdapterTargets
from loraplex.lora.sources.named import AdapterModule
from loraplex.lora.sources.store import AdapterStore
from loraplex.protocol.openai import checked_sampling_defaults
from loraplex.server import adapter_admin, embeddings, native, openai_routes, playground, vllm_routes
from loraplex.server.docs import mount_docs
from loraplex.server.errors import install_error_handlers
from loraplex.server.metrics import Metrics
from loraplex.server.auth import ApiKeys
from loraplex.server.disconnects import CancelOnDisconnect
from loraplex.server.request_log import RequestLog
from loraplex.server.state import ServerState, get_state
from loraplex.server.validation import Validation

log = logging.getLogger("loraplex.server")


def generation_config_defaults(pairs: tuple[tuple[str, float], ...]) -> dict[str, float]:
    """The OpenAI routes' sampling defaults from the model's generation config, said once at start-up."""
    defaults, refused = checked_sampling_defaults(pairs)
    for line in refused:
        log.warning(line)
    if defaults:
        values = ", ".join(f"{name}={value}" for name, value in defaults.items())
        log.info(f"OpenAI requests take generation_config.json's {values} where they set none "
                 "(--generation-config ignore: they do not)")
    return defaults


def create_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    app = FastAPI(
        title="loraplex", version=__version__, description="Multi-LoRA inference server (LoRAX/TGI and OpenAI APIs).",
        docs_url=None, redoc_url=None,  # served below from local files: no CDN, works offline
    )
    config = config or ServerConfig()
    model = engine.model
    validation = Validation(config.validation_workers, model.max_input_length, model.tokenizer.longest_token_chars)
    served_name = config.served_model_name[0] if config.served_model_name else model.model_id
    state = ServerState(engine, config, Metrics(served_name, engine.stats),
                        adapter_store(model.adapter_targets, config), validation=validation)
    state.metrics.watch_admission(state.admission)
    engine.prepare_grammars()  # off the loop, now: not at the first structured-output request
    if config.generation_config == "auto":
        state.sampling_defaults = generation_config_defaults(model.sampling_defaults)
    app.state.loraplex = state
    # Each added layer wraps those added before it: RequestLog > CORS > ApiKeys > CancelOnDisconnect > routes.
    # The body is read (capped, timed) inside the keys: a request without a valid key is answered 401 before a byte
    # of its body is read.
    app.add_middleware(CancelOnDisconnect, timeout_s=config.request_timeout_s, max_body_bytes=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(ApiKeys, keys=config.api_keys)
    if state.config.cors_allow_origin:  # outside the keys: it answers preflights and marks their 401s
        app.add_middleware(
            CORSMiddleware, allow_origins=list(state.config.cors_allow_origin), allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(RequestLog)  # added last: outermost, so its line has the status CORS answered too
    install_error_handlers(app)
    app.include_router(native.router)
    app.include_router(openai_routes.router)
    app.include_router(playground.router)
    app.include_router(adapter_admin.router)
    app.include_router(vllm_routes.router)
    app.include_router(embeddings.router)

    mount_docs(app)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text exposition format)")
    async def metrics(request: Request) -> Response:
        return PlainTextResponse(get_state(request).metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app


def default_load_threads() -> int:
    """Adapter loads at once when --adapter-load-threads is not given: half the CPU cores, 2 to 8 (the other half
    for the engine, the event loop and the validation workers)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def adapter_store(targets: AdapterTargets, config: ServerConfig) -> AdapterStore:
    """The store for the server's adapters, with `--preloaded-adapter-ids` loaded (a failure stops the start)."""
    store = AdapterStore(
        targets.base_shapes, targets.max_rank, config.adapter_roots, config.adapter_source,
        config.max_cpu_adapters, base_weight=targets.base_weight,
        checkpoint_name=targets.checkpoint_name, access_ttl_s=config.adapter_access_ttl_s,
        loader_threads=config.adapter_load_threads or default_load_threads(), flat_format=targets.flat_format,
    )
    store.preload(config.preloaded_adapter_ids)
    for entry in config.lora_modules:  # the operator's: any local directory, held for as long as the server runs
        module = AdapterModule.parse(entry)
        store.register(module.name, module.path, trusted=True, base_model_name=module.base_model_name)
        log.info("adapter %r served from %s", module.name, module.path)
    if config.default_adapter_id and config.default_adapter_id not in store.named:  # --adapter-id: loaded now
        store.preload([config.default_adapter_id])
    return store

