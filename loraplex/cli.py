"""loraplex serve | generate | bench — the only argument parsing in the project."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from loraplex.config import KV_CACHE_DTYPES, EngineConfig, ServerConfig
from loraplex.multimodal.config import MediaConfig
from loraplex.quantization import QUANTIZE_CHOICES, QuantizationError


_ENV_NAMES: set[str] = set()  # the environment variables flags read (listed by --help)
_ENV_OF = {"hostname": "HOSTNAME_BIND"}  # flags whose variable is not their name in capitals


class UsageError(Exception):
    """A user error reported as one line and exit status 2 (no traceback)."""


def _env(name: str, default=None, cast=str):
    """LoRAX-style flags may also come from the environment (MODEL_ID, PORT, ...)."""
    _ENV_NAMES.add(name)
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return cast(value)
    except (ValueError, argparse.ArgumentTypeError) as exc:  # read before argparse runs: reported as main's errors
        raise UsageError(f"environment variable {name}={value!r}: {exc}") from None


def _describe_defaults(parser: argparse.ArgumentParser) -> None:
    """--help: after each flag's text, its default and the environment variable it may come from."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version") or "%(default)" in (action.help or ""):
            continue
        env = _ENV_OF.get(action.dest, action.dest.upper())
        notes = [] if action.default in (None, False) else ["default: %(default)s"]
        if env in _ENV_NAMES:
            notes.append(f"env {env}")
        if notes:
            action.help = f"{action.help} ({'; '.join(notes)})" if action.help else f"({'; '.join(notes)})"


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag: one line saying what is wrong and where the help is (not the whole usage)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(value: str) -> int:
    """Sizes and limits that 0 would make useless (a prefill budget of 0 would never start a request)."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-id", default=_env("MODEL_ID"), help="HF directory, cached repo id or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=_env("DTYPE"), choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=_env("DEVICE"), help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--max-input-length", type=_positive, default=_env("MAX_INPUT_LENGTH", 4095, int))
    p.add_argument("--max-total-tokens", type=_positive, default=_env("MAX_TOTAL_TOKENS", 4096, int))
    p.add_argument("--max-batch-prefill-tokens", type=_positive, default=_env("MAX_BATCH_PREFILL_TOKENS", 4096, int))
    p.add_argument("--max-batch-total-tokens", type=_positive, default=_env("MAX_BATCH_TOTAL_TOKENS", None, int),
                   help="KV cache capacity in tokens (default: sized from free memory)")
    p.add_argument("--max-active-adapters", type=_positive, default=_env("MAX_ACTIVE_ADAPTERS", 128, int),
                   help="device slots for adapters: distinct adapters one step can run")
    p.add_argument("--max-lora-rank", type=_positive, default=_env("MAX_LORA_RANK", 64, int))
    p.add_argument("--adapter-cycle-time-s", type=float, default=_env("ADAPTER_CYCLE_TIME_S", 2.0, float),
                   help="when more adapters wait than slots exist, how long one keeps its slot before yielding it")
    p.add_argument("--chat-template", default=_env("CHAT_TEMPLATE"),
                   help="a Jinja chat template file (for checkpoints that ship none, e.g. MPT)")
    p.add_argument("--quantize", default=_env("QUANTIZE"), choices=QUANTIZE_CHOICES,
                   help="quantize a float checkpoint's linears as it loads: bitsandbytes int8 (LLM.int8), nf4 or fp4, "
                        "or fp8 (e4m3, CUDA compute capability 8.9+); pre-quantized GPTQ, AWQ, FP8 and "
                        "compressed-tensors checkpoints load as published without it (LoRA adapters run on top in "
                        "the model's dtype)")
    p.add_argument("--kv-cache-dtype", default=_env("KV_CACHE_DTYPE", "auto"), choices=KV_CACHE_DTYPES,
                   help="what the paged KV cache stores: auto (the model's dtype) or fp8 (e4m3 with per-layer scales: "
                        "half the bytes of bfloat16, twice the tokens; CPU, or CUDA compute capability 8.9+)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_env("PREFIX_CACHING", True, _truthy),
                   help="share computed KV blocks between requests with the same prompt prefix, adapter and images "
                        "(on by default; outputs are unchanged)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=_env("CUDA_GRAPHS", True, _truthy),
                   help="on CUDA, replay decode steps as CUDA graphs (on by default; --no-cuda-graphs runs every "
                        "step eagerly; no effect on CPU)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=_env("WARM_UP", None, _truthy),
                   help="before serving, run made-up requests that compile the kernels and capture the decode graphs, "
                        "so the first requests do not wait for them (default: on CUDA only)")
    p.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=_env("OVERLAP_STEPS", None, _truthy),
                   help="launch each decode step before the host has read the last one's tokens (default: on with "
                        "CUDA graphs; outputs unchanged)")
    # LoRAX's batching knobs (engine/joins.py): they act where decode steps replay CUDA graphs.
    p.add_argument("--max-waiting-tokens", type=_non_negative, default=_env("MAX_WAITING_TOKENS", 20, _non_negative),
                   help="with CUDA graphs: decode steps a waiting request may wait before it joins the running ones "
                        "(0: it joins at every step)")
    p.add_argument("--waiting-served-ratio", type=_positive_float, default=_env("WAITING_SERVED_RATIO", 1.2, _positive_float),
                   help="with CUDA graphs: waiting requests join at once when they number at least this many times "
                        "the running ones")
    p.add_argument("--speculative-tokens", type=_non_negative, default=_env("SPECULATIVE_TOKENS", 0, _non_negative),
                   help="speculative decoding: up to N tokens per step guessed from each request's own text "
                        "(n-gram lookup) and verified by the model; outputs unchanged (default 0: off)")
    p.add_argument("--max-grammar-bytes", type=int, default=_env("MAX_GRAMMAR_BYTES", 64 * 1024, int),
                   help="structured output: the largest JSON schema / regex / choice list a request may send")
    p.add_argument("--grammar-compile-timeout-s", type=float, default=_env("GRAMMAR_COMPILE_TIMEOUT_S", 10.0, float),
                   help="structured output: a grammar that takes longer to compile is refused")
    p.add_argument("--revision", default=_env("REVISION"), help="a hub model's branch, tag or commit (default: main)")
    p.add_argument("--huggingface-hub-cache", default=_env("HUGGINGFACE_HUB_CACHE"),
                   help="the Hugging Face hub cache models and adapters are read from and downloaded to "
                        "(default: HF_HUB_CACHE, else HF_HOME/hub)")
    p.add_argument("--trust-remote-code", action="store_true", default=_env("TRUST_REMOTE_CODE", False, _truthy),
                   help="refused: loraplex runs its own implementation of each model family, never a checkpoint's code")
    p.add_argument("--cuda-memory-fraction", type=_fraction, default=_env("CUDA_MEMORY_FRACTION", 1.0, _fraction),
                   help="the share of the GPU's memory this server may use")
    p.add_argument("--adapter-memory-fraction", type=_fraction, default=_env("ADAPTER_MEMORY_FRACTION", 0.1, _fraction),
                   help="at most this share of the GPU's memory is kept out of the KV cache for adapter weights")
    p.add_argument("--adapter-source", default=_env("ADAPTER_SOURCE", "hub"), choices=["hub", "local", "s3"],
                   help="where adapter ids are looked up unless a request says otherwise")
    p.add_argument("--adapter-root", action="append", default=_env("ADAPTER_ROOT", None, lambda v: v.split(",")),
                   help="directory local adapters may be loaded from (repeatable; none: local adapters off)")


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0.0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return number


def _add_media_args(p: argparse.ArgumentParser) -> None:
    """Where images may come from (vLLM's flag names) and how large they may be. Data URLs always work."""
    d = MediaConfig()
    p.add_argument("--allowed-local-media-path", default=_env("ALLOWED_LOCAL_MEDIA_PATH"),
                   help="directory images may be read from (file:// URLs or paths); default: local files refused")
    p.add_argument("--allowed-media-domains", nargs="+", default=_env("ALLOWED_MEDIA_DOMAINS", None, lambda v: v.split(",")),
                   help="hosts http(s) images may come from (exact names; a listed literal IP may be private)")
    p.add_argument("--allow-private-media-addresses", action="store_true",
                   default=_env("ALLOW_PRIVATE_MEDIA_ADDRESSES", False, _truthy),
                   help="let listed host names resolve to loopback / private / link-local addresses")
    p.add_argument("--max-images-per-request", type=int, default=_env("MAX_IMAGES_PER_REQUEST", d.max_images_per_request, int))
    p.add_argument("--max-image-bytes", type=int, default=_env("MAX_IMAGE_BYTES", d.max_image_bytes, int))
    p.add_argument("--max-image-pixels", type=int, default=_env("MAX_IMAGE_PIXELS", d.max_image_pixels, int))
    p.add_argument("--media-fetch-timeout-s", type=float, default=_env("MEDIA_FETCH_TIMEOUT_S", d.fetch_timeout_s, float))


def _media_config(args: argparse.Namespace) -> MediaConfig:
    return MediaConfig(
        allowed_local_media_path=os.path.abspath(args.allowed_local_media_path) if args.allowed_local_media_path else None,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allow_private_addresses=args.allow_private_media_addresses,
        max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        fetch_timeout_s=args.media_fetch_timeout_s,
    )


def _load_engine(args: argparse.Namespace, show_progress: bool = False, log=None):
    """The engine the flags describe; what a user got wrong (a model that does not exist or that we do not
    serve, a device this machine lacks, a refused flag) as a UsageError."""
    from loraplex.checkpoints.weights import WeightsError
    from loraplex.engine.engine import Engine
    from loraplex.layers.kv_quant import KVCacheDtypeError

    if args.trust_remote_code:
        raise UsageError("--trust-remote-code is not supported: loraplex runs its own implementation of each model "
                         "family (Llama, Mistral, Qwen2, MPT, LLaVA-NeXT, Mllama, T5, BART), never a checkpoint's code")
    if args.max_input_length >= args.max_total_tokens:  # TGI refuses it too: no room for a generated token
        raise UsageError(f"--max-input-length ({args.max_input_length}) must be < --max-total-tokens "
                         f"({args.max_total_tokens}): a prompt that long leaves no room for a generated token")
    _check_adapter_roots(args.adapter_root or ())
    device = args.device or ""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available on this machine (try --device cpu)")
    try:
        engine = Engine.from_config(_engine_config(args), show_progress=show_progress, log=log)
    except (WeightsError, QuantizationError, KVCacheDtypeError) as exc:
        raise UsageError(str(exc)) from exc
    except ValueError as exc:  # the model's config names something we do not serve (models/registry.py config_from_hf)
        raise UsageError(f"cannot serve {args.model_id or 'the default model'}: {exc}") from exc
    if engine.warms_up:
        report = engine.warm_up()
        (log or _to_stderr)(f"warmed up: {report.requests} made-up requests, {report.graphs_captured} decode graphs "
                            f"captured, in {report.seconds:.1f}s")
    return engine


def _check_adapter_roots(roots) -> None:
    """Each --adapter-root is a directory this process can list and read (checked before any weight is read)."""
    for root in roots:
        if not os.path.isdir(root):
            raise UsageError(f"--adapter-root {root}: {'not a directory' if os.path.exists(root) else 'no such directory'}")
        if not os.access(root, os.R_OK | os.X_OK):
            raise UsageError(f"--adapter-root {root}: not readable by this process")


def _bound_socket(hostname: str, port: int) -> socket.socket:
    """The server's socket, bound now (before the model loads: a port in use fails the start at once) and not yet
    listening (connections are refused, not queued, until the server is ready)."""
    try:
        family = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise UsageError(f"cannot listen on {hostname}:{port}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((hostname, port))
    except OSError as exc:
        sock.close()
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise UsageError(f"cannot listen on {hostname}:{port}: {why}") from None
    return sock


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_id=args.model_id,
        dtype=args.dtype,
        device=args.device,
        max_input_length=args.max_input_length,
        max_total_tokens=args.max_total_tokens,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_batch_total_tokens=args.max_batch_total_tokens,
        max_active_adapters=args.max_active_adapters,
        max_lora_rank=args.max_lora_rank,
        adapter_cycle_time_s=args.adapter_cycle_time_s,
        chat_template=args.chat_template,
        quantize=args.quantize,
        kv_cache_dtype=args.kv_cache_dtype,
        prefix_caching=args.prefix_caching,
        speculative_tokens=args.speculative_tokens,
        cuda_graphs=args.cuda_graphs,
        overlap_steps=args.overlap_steps,
        revision=args.revision,
        cuda_memory_fraction=args.cuda_memory_fraction,
        adapter_memory_fraction=args.adapter_memory_fraction,
        max_grammar_bytes=args.max_grammar_bytes,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
        max_waiting_tokens=args.max_waiting_tokens,
        waiting_served_ratio=args.waiting_served_ratio,
        warm_up=args.warm_up,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from loraplex.params import SamplingParams

    engine = _load_engine(args)
    tokenizer = engine.tokenizer
    if args.chat:
        prompt_ids = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]), add_special_tokens=False
        )
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature or 1.0,
        top_p=args.top_p or 1.0,
        top_k=args.top_k or 0,
        seed=args.seed,
        do_sample=any(v is not None for v in (args.temperature, args.top_p, args.top_k, args.seed)),
    )
    adapter = None
    if args.adapter_id:
        from loraplex.server.app import adapter_store

        store = adapter_store(engine.adapter_targets(), ServerConfig(adapter_source=args.adapter_source, adapter_roots=tuple(args.adapter_root or ())))
        adapter = store.load(args.adapter_id)
    (result,) = engine.generate([prompt_ids], params, adapters=[adapter])
    print(result.generated_text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.server.app import create_app
    from loraplex.server.heap import freeze_start_up_heap

    from loraplex.server.logs import configure_logging
    from loraplex.server.shutdown import DrainingServer

    configure_logging(args.json_output)
    if args.otlp_endpoint:
        from loraplex.server.tracing import TracingUnavailable, configure_tracing

        try:
            configure_tracing(args.otlp_endpoint)
        except TracingUnavailable as exc:
            raise UsageError(str(exc)) from exc
    logger = logging.getLogger("loraplex")
    sock = _bound_socket(args.hostname, args.port)
    # --json-output: every line on stderr is a JSON object, so progress goes through the logger, without bars.
    engine = _load_engine(args, show_progress=not args.json_output, log=logger.info if args.json_output else None)
    server_config = ServerConfig(
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_stop_sequences=args.max_stop_sequences,
        max_best_of=args.max_best_of,
        json_output=args.json_output,
        cors_allow_origin=tuple(args.cors_allow_origin or ()),
        adapter_source=args.adapter_source,
        adapter_roots=tuple(args.adapter_root or ()),
        preloaded_adapter_ids=tuple(args.preloaded_adapter_ids or ()),
        max_cpu_adapters=args.max_cpu_adapters,
        adapter_access_ttl_s=args.adapter_access_ttl_s,
        media=_media_config(args),
        validation_workers=args.validation_workers,
        default_max_tokens=args.default_max_tokens,
        generation_config=args.generation_config,
        request_timeout_s=args.request_timeout_s,
        max_request_bytes=args.max_request_bytes,
        api_keys=tuple(args.api_key or ()),
    )
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, server_config)
    freeze_start_up_heap()  # later full collections, which pause the engine thread, skip the model (heap.py)
    # Listen before saying "ready": from that line on, connections queue in the backlog.
    sock.listen(2048)
    ready = (
        f"loraplex ready: {engine.model_id} on {engine.device} ({str(engine.dtype).removeprefix('torch.')}"
        f"{', quantized ' + args.quantize if args.quantize else ''}), "
        f"KV cache {engine.kv_capacity_tokens} tokens ({str(engine.kv_cache_dtype).removeprefix('torch.')}), "
        f"http://{args.hostname}:{args.port}"
    )
    if args.json_output:
        logger.info(ready)
    else:  # printed, not logged: the line scripts wait for starts with "loraplex ready"
        print(ready, file=sys.stderr, flush=True)
    log_config = None if args.json_output else uvicorn.config.LOGGING_CONFIG
    config = uvicorn.Config(app, log_level="warning", log_config=log_config)
    DrainingServer(config, app.state.loraplex.shutting_down, args.shutdown_timeout_s).run(sockets=[sock])
    # Drained: stop the engine's thread before the interpreter goes (one left mid-step aborts the process).
    async_engine.shutdown()
    app.state.loraplex.validation.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.offline import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    from loraplex import __version__

    parser = _Parser(prog="loraplex", description="Multi-LoRA inference server.")
    parser.add_argument("--version", action="version", version=f"loraplex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the HTTP server")
    _add_engine_args(serve)
    serve.add_argument("--hostname", default=_env("HOSTNAME_BIND", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=_env("PORT", 8080, int))
    serve.add_argument("--max-concurrent-requests", type=_positive, default=_env("MAX_CONCURRENT_REQUESTS", 128, int),
                       help="requests in flight at once; more get 429 with a Retry-After header")
    serve.add_argument("--max-queued-tokens", type=_positive, default=_env("MAX_QUEUED_TOKENS", None, _positive),
                       help="prompt + max_new_tokens of the requests in flight (admitted, not finished: waiting, "
                            "preempted or running); a request past it gets 429 with a Retry-After header, but one is "
                            "always admitted when none is in flight (default: off; a few times the KV cache, /info's "
                            "max_batch_total_tokens, bounds the queue's wait)")
    serve.add_argument("--max-stop-sequences", type=int, default=_env("MAX_STOP_SEQUENCES", 4, int))
    serve.add_argument("--max-best-of", type=int, default=_env("MAX_BEST_OF", 2, int))
    serve.add_argument("--json-output", action="store_true", default=_env("JSON_OUTPUT", False, _truthy))
    serve.add_argument("--default-max-tokens", type=_positive, default=_env("DEFAULT_MAX_TOKENS", None, _positive),
                       help="cap what an OpenAI request without max_tokens generates (chat: up to the context "
                            "limit otherwise; completions: 16)")
    serve.add_argument("--generation-config", default=_env("GENERATION_CONFIG", "auto"), choices=["auto", "ignore"],
                       help="auto: OpenAI requests take the model's generation_config.json temperature, top_p, top_k, "
                            "min_p and repetition_penalty where they set none (as vLLM); ignore: they do not. The "
                            "native API never takes them (as LoRAX)")
    serve.add_argument("--shutdown-timeout-s", type=_positive_float, default=_env("SHUTDOWN_TIMEOUT_S", 30.0, _positive_float),
                       help="after SIGTERM, how long requests in flight may go on; then each still running ends "
                            "with an error event (a stream) or a 503, and the server exits 0")
    serve.add_argument("--request-timeout-s", type=float, default=_env("REQUEST_TIMEOUT_S", None, float),
                       help="abort a request still running after this many seconds (504 when nothing was sent yet)")
    serve.add_argument("--max-request-bytes", type=int, default=_env("MAX_REQUEST_BYTES", 32 * 1024 * 1024, int),
                       help="refuse request bodies larger than this (413), before parsing them")
    serve.add_argument("--api-key", action="append", default=_env("API_KEY", None, lambda v: v.split(",")),
                       help="require this key (Authorization: Bearer KEY) on every route but /health and /ping (GET, HEAD) "
                            "and OPTIONS (repeatable; the environment variable takes a comma-separated list)")
    serve.add_argument("--otlp-endpoint", default=_env("OTLP_ENDPOINT"),
                       help="send a trace span per request to this OpenTelemetry collector, over OTLP/HTTP "
                            "(e.g. http://collector:4318; needs the otlp extra)")
    serve.add_argument("--cors-allow-origin", action="append", default=_env("CORS_ALLOW_ORIGIN", None, lambda v: v.split(",")),
                       help="answer browsers from this origin (repeatable): preflights and every response, 401s "
                            "included, carry the CORS headers")
    serve.add_argument("--preloaded-adapter-ids", nargs="+", default=_env("PRELOADED_ADAPTER_IDS", None, lambda v: v.split(",")),
                       help="adapters (of --adapter-source) loaded at start and listed by /v1/models")
    serve.add_argument("--max-cpu-adapters", type=int, default=_env("MAX_CPU_ADAPTERS", 64, int),
                       help="loaded adapters kept in host memory besides the preloaded ones (LRU)")
    serve.add_argument("--adapter-access-ttl-s", type=float, default=_env("ADAPTER_ACCESS_TTL_S", 30.0, float),
                       help="how long the hub's answer on whether a request's api_token may read a hub adapter "
                            "is reused for requests with the same token (0: every request asks the hub)")
    serve.add_argument("--validation-workers", type=_positive, default=_env("VALIDATION_WORKERS", 2, _positive),
                       help="threads that tokenize prompts, render chat templates and build /tokenize's answers, "
                            "off the event loop")
    _add_media_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt and print it")
    gen.add_argument("prompt")
    _add_engine_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    gen.add_argument("--adapter-id", help="generate with this LoRA adapter (of --adapter-source)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(func=cmd_generate)

    # The benchmark parses its own options (benchmarks/offline.py): everything after "bench" goes to it.
    bench = sub.add_parser("bench", help="offline throughput benchmark against transformers", add_help=False)
    bench.set_defaults(func=cmd_bench)
    for command in (serve, gen):
        _describe_defaults(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    from loraplex.lora.adapter import AdapterError

    try:
        args, rest = build_parser().parse_known_args(argv)
        if getattr(args, "func", None) is cmd_bench:
            args.bench_args = rest
        elif rest:
            build_parser().parse_args(argv)  # reports the unrecognised arguments and exits
        if getattr(args, "huggingface_hub_cache", None):  # before anything imports huggingface_hub
            os.environ["HF_HUB_CACHE"] = args.huggingface_hub_cache
        return args.func(args)
    except (AdapterError, QuantizationError, UsageError) as exc:  # what the user can fix: one line, no traceback
        print(f"loraplex: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
