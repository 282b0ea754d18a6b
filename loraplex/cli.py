"""loraplex serve | generate | bench — the only argument parsing in the project."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from loraplex.config import HELP_GROUPS, EngineConfig, ServerConfig
from loraplex.multimodal.config import MediaConfig
from loraplex.quantization import QUANTIZE_CHOICES, QuantizationError
from loraplex.settings import (
    _positive, _positive_float, _truthy, add_arguments, add_groups, from_namespace, group_of,
)


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
        env = getattr(action, "env", None) or _ENV_OF.get(action.dest, action.dest.upper())
        notes = [] if action.default in (None, False) else ["default: %(default)s"]
        if env in _ENV_NAMES:
            notes.append(f"env {env}")
        if notes:
            action.help = f"{action.help} ({'; '.join(notes)})" if action.help else f"({'; '.join(notes)})"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag: one line saying what is wrong and where the help is (not the whole usage)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """EngineConfig's flags (its fields' declarations), two that are no setting, and ServerConfig's adapter flags,
    each in its --help group (config.HELP_GROUPS; the parser has them: settings.add_groups)."""
    add_arguments(p, EngineConfig, _env, choices={"quantize": QUANTIZE_CHOICES}, groups=HELP_GROUPS)
    model = group_of(p, "model")
    model.add_argument("--huggingface-hub-cache", default=_env("HUGGINGFACE_HUB_CACHE"),
                       help="the Hugging Face hub cache models and adapters are read from and downloaded to "
                            "(default: HF_HUB_CACHE, else HF_HOME/hub)")
    model.add_argument("--trust-remote-code", action="store_true", default=_env("TRUST_REMOTE_CODE", False, _truthy),
                       help="refused: loraplex runs its own implementation of each model family, never a checkpoint's "
                            "code")
    add_arguments(p, ServerConfig, _env, stop="max_concurrent_requests", groups=HELP_GROUPS)  # adapter_source, _roots


def _add_media_args(p: argparse.ArgumentParser) -> None:
    """Where images may come from (vLLM's flag names) and how large they may be, in --help's limits group. Data URLs
    always work."""
    d = MediaConfig()
    p = group_of(p, "limits")
    p.add_argument("--allowed-local-media-path", default=_env("ALLOWED_LOCAL_MEDIA_PATH"),
                   help="directory images may be read from (file:// URLs or paths); default: local files refused")
    p.add_argument("--allowed-media-domains", nargs="+", default=_env("ALLOWED_MEDIA_DOMAINS", None, lambda v: v.split(",")),
                   help="hosts http(s) images may come from (exact names; a listed literal IP may be private)")
    p.add_argument("--allow-private-media-addresses", action="store_true",
                   default=_env("ALLOW_PRIVATE_MEDIA_ADDRESSES", False, _truthy),
                   help="let listed host names resolve to loopback / private / link-local addresses")
    p.add_argument("--max-images-per-request", type=_positive,
                   default=_env("MAX_IMAGES_PER_REQUEST", d.max_images_per_request, _positive))
    p.add_argument("--max-image-bytes", type=_positive, default=_env("MAX_IMAGE_BYTES", d.max_image_bytes, _positive))
    p.add_argument("--max-image-pixels", type=_positive, default=_env("MAX_IMAGE_PIXELS", d.max_image_pixels, _positive))
    p.add_argument("--media-fetch-timeout-s", type=_positive_float,
                   default=_env("MEDIA_FETCH_TIMEOUT_S", d.fetch_timeout_s, _positive_float))
    p.add_argument("--max-decoded-image-bytes", type=_positive,
                   default=_env("MAX_DECODED_IMAGE_BYTES", d.max_decoded_bytes_per_request, _positive),
                   help="a request's images decoded (width x height x 3 bytes each), counted before decoding (413)")
    p.add_argument("--max-decoded-image-bytes-total", type=_positive,
                   default=_env("MAX_DECODED_IMAGE_BYTES_TOTAL", d.max_decoded_bytes_total, _positive),
                   help="all requests' images decoded at once; a request that does not fit beside the others waits")


def _media_config(args: argparse.Namespace) -> MediaConfig:
    return MediaConfig(
        allowed_local_media_path=os.path.abspath(args.allowed_local_media_path) if args.allowed_local_media_path else None,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allow_private_addresses=args.allow_private_media_addresses,
        max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        fetch_timeout_s=args.media_fetch_timeout_s,
        max_decoded_bytes_per_request=args.max_decoded_image_bytes,
        max_decoded_bytes_total=args.max_decoded_image_bytes_total,
    )


def _load_engine(args: argparse.Namespace, show_progress: bool = False, log=None):
    """The engine the flags describe; what a user got wrong (a model that does not exist or that we do not
    serve, a device this machine lacks, a refused flag) as a UsageError."""
    from loraplex.checkpoints.weights import WeightsError
    from loraplex.engine.engine import Engine, LengthsError
    from loraplex.layers.kv_quant import KVCacheDtypeError

    if args.trust_remote_code:
        raise UsageError("--trust-remote-code is not supported: loraplex runs its own implementation of each model "
                         "family (Llama, Mistral, Qwen2, MPT, LLaVA-NeXT, Mllama, T5, BART), never a checkpoint's code")
    _check_lengths(args.max_input_length, args.max_total_tokens)
    _check_adapter_roots(args.adapter_root or ())
    device = args.device or ""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available on this machine (try --device cpu)")
    try:
        engine = Engine.from_config(_engine_config(args), show_progress=show_progress, log=log)
    except (WeightsError, QuantizationError, KVCacheDtypeError, LengthsError) as exc:
        raise UsageError(str(exc)) from exc
    except ValueError as exc:  # the model's config names something we do not serve (models/registry.py config_from_hf)
        raise UsageError(f"cannot serve {args.model_id or 'the default model'}: {exc}") from exc
    if engine.warms_up:
        report = engine.warm_up()
        (log or _to_stderr)(f"warmed up: {report.requests} made-up requests, {report.graphs_captured} decode graphs "
                            f"captured, in {report.seconds:.1f}s")
    return engine


def _check_lengths(max_input_length: int | None, max_total_tokens: int | None) -> None:
    """Both lengths given: the input one below the total (TGI refuses it too), before any weight is read. The model's
    context bounds them once it is known (engine.py resolve_lengths)."""
    if max_input_length is not None and max_total_tokens is not None and max_input_length >= max_total_tokens:
        raise UsageError(f"--max-input-length ({max_input_length}) must be < --max-total-tokens ({max_total_tokens}): "
                         f"a prompt that long leaves no room for a generated token")


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
    return from_namespace(EngineConfig, args)


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

        store = adapter_store(engine.adapter_targets(), from_namespace(ServerConfig, args))  # the adapter settings
        adapter = store.load(args.adapter_id)
    (result,) = engine.generate([prompt_ids], params, adapters=[adapter])
    print(result.generated_text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from loraplex.server.logs import configure_logging

    configure_logging(args.json_output)
    if args.otlp_endpoint:
        from loraplex.server.tracing import TracingUnavailable, configure_tracing

        try:
            configure_tracing(args.otlp_endpoint)
        except TracingUnavailable as exc:
            raise UsageError(str(exc)) from exc
    logger = logging.getLogger("loraplex")
    _check_lora_modules(args.lora_modules or ())
    sock = _bound_socket(args.hostname, args.port)
    # --json-output: every line on stderr is a JSON object, so progress goes through the logger, without bars.
    engine = _load_engine(args, show_progress=not args.json_output, log=logger.info if args.json_output else None)
    return serve_engine(engine, args, sock)


def serve_engine(engine, args: argparse.Namespace, sock: socket.socket) -> int:
    """Serve `engine` (loaded, warmed up) over HTTP on `sock` (bound, not listening) with the server flags of `args`,
    until drained. Benchmarks serve engines of their own through it (benchmarks/cold_adapters.py)."""
    import uvicorn

    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.server.app import create_app
    from loraplex.server.heap import freeze_start_up_heap
    from loraplex.server.shutdown import DrainingServer

    logger = logging.getLogger("loraplex")
    server_config = from_namespace(ServerConfig, args, media=_media_config(args))
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


def _check_lora_modules(entries) -> None:
    """--lora-modules entries are read before any weight is (a typo is one line, exit 2)."""
    from loraplex.lora.sources.named import AdapterModule

    for entry in entries:
        try:
            AdapterModule.parse(entry)
        except ValueError as exc:
            raise UsageError(f"--lora-modules: {exc}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.offline import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    from loraplex import __version__

    parser = _Parser(
        prog="loraplex", description="Multi-LoRA inference server: one base model, many LoRA adapters per batch.",
        epilog="Each command's flags: loraplex serve --help (by topic: model, adapters, scheduling and memory, "
               "server, limits, observability), loraplex generate --help, loraplex bench --help.")
    parser.add_argument("--version", action="version", version=f"loraplex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands")

    serve = sub.add_parser(
        "serve", help="load a model and serve it and its LoRA adapters over HTTP (LoRAX/TGI and OpenAI APIs); "
                      "its flags: loraplex serve --help",
        usage="%(prog)s [-h] [FLAG ...]",  # not each of its 70-odd flags: they follow, by topic
        description="Serve a model and its LoRA adapters over HTTP. The flags are grouped by topic; most may also "
                    "come from the environment variable their help names.")
    add_groups(serve, HELP_GROUPS)  # --help's topics, in order: each flag goes into one
    _add_engine_args(serve)
    server = group_of(serve, "server")
    server.add_argument("--hostname", default=_env("HOSTNAME_BIND", "127.0.0.1"))
    server.add_argument("--port", type=int, default=_env("PORT", 8080, int))
    add_arguments(serve, ServerConfig, _env, start="max_concurrent_requests", groups=HELP_GROUPS)
    server.add_argument("--shutdown-timeout-s", type=_positive_float,
                        default=_env("SHUTDOWN_TIMEOUT_S", 30.0, _positive_float),
                        help="after SIGTERM, how long requests in flight may go on; then each still running ends "
                             "with an error event (a stream) or a 503, and the server exits 0")
    group_of(serve, "observability").add_argument(
        "--otlp-endpoint", default=_env("OTLP_ENDPOINT"),
        help="send a trace span per request to this OpenTelemetry collector, over OTLP/HTTP "
             "(e.g. http://collector:4318; needs the otlp extra)")
    _add_media_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser(
        "generate", help="load a model, generate text for one prompt (with an adapter if asked) and print it",
        usage="%(prog)s [-h] prompt [FLAG ...]",
        description="Generate text for one prompt and print it (no server). The engine's flags are serve's.")
    gen.add_argument("prompt")
    add_groups(gen, HELP_GROUPS, only=("model", "adapters", "scheduling and memory", "limits"))
    _add_engine_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    add_arguments(gen, ServerConfig, _env, start="default_adapter_id", stop="allow_runtime_lora_updating",
                  groups=HELP_GROUPS)  # --adapter-id
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(func=cmd_generate)

    # The benchmark parses its own options (benchmarks/offline.py): everything after "bench" goes to it.
    bench = sub.add_parser("bench", help="offline throughput benchmark against transformers; its options: "
                                         "loraplex bench --help", add_help=False)
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
