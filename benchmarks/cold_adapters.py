"""Cold adapters over HTTP: what a first use of adapters costs the whole server (issue 57's workload).

    python -m benchmarks.cold_adapters --model 8b          # on the GPU: Llama-3.1-8B's shape, random weights
    python -m benchmarks.cold_adapters --model default     # anywhere: the embedded default model (a smoke run)

One server (`loraplex serve`'s own code, `cli.serve_engine`, in a subprocess; for `8b` the engine is built in place
on a random model of the 8B shape with the default model's tokenizer, since no checkpoint can be downloaded) and
PEFT adapters written for it (rank 16 on all seven projections, bfloat16, flushed out of the page cache so that a
first use reads the disk). Waves of concurrent streamed `/generate_stream` requests, in this order on the one
server, each request `--new-tokens` tokens (EOS ignored):

1. `base`: the base model; 2. `cold`: over `--adapters` adapters never used before; 3. `warm`: the same adapters
again (loaded); 4. one request on one cold adapter against one base request, and the time to read that adapter's
bytes from disk (another adapter's file of the same size, read cold); 5. `warm`, then `warm` while 8 requests on 8
cold adapters arrive with it: the warm requests' TTFT p99 in each.

Printed as a table, and written as JSON to `--out` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import torch

# (hidden, key/value width, intermediate, layers) of the models' linears, for the adapters' shapes.
SHAPES = {"8b": (4096, 1024, 14336, 32), "default": (576, 192, 1536, 30)}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Tell me a long story about a lighthouse keeper who finds a map in a bottle, with many details."


def _linears(model: str, layers: int | None = None) -> dict[str, tuple[int, int]]:
    """PEFT's module path -> (in, out) for each projection of each layer (the model's layers, or the first `layers`)."""
    hidden, kv, intermediate, all_layers = SHAPES[model]
    layers = layers or all_layers
    sizes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
             "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
    part = lambda p: "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"  # noqa: E731
    return {f"model.layers.{layer}.{part(p)}.{p}": sizes[p] for layer in range(layers) for p in PROJECTIONS}


def write_adapters(root: pathlib.Path, names: list[str], model: str, rank: int = 16, layers: int | None = None) -> int:
    """PEFT adapter directories `root/name` (distinct random weights each), flushed out of the page cache.
    Returns one adapter's weight file size in bytes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    base = {}
    for module, (fan_in, fan_out) in _linears(model, layers).items():
        base[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
        base[f"base_model.model.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) / rank ** 0.5
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(PROJECTIONS), "bias": "none", "base_model_name_or_path": model}
    size = 0
    for k, name in enumerate(names):
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_config.json").write_text(json.dumps(config))
        weights = directory / "adapter_model.safetensors"
        save_file({key: (t * (1 + k / 64)).to(torch.bfloat16) for key, t in base.items()}, str(weights))
        size = weights.stat().st_size
        _drop_from_page_cache(weights)
    return size


def _drop_from_page_cache(path: pathlib.Path) -> None:
    """Written out and dropped from the page cache: its next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---- the server -------------------------------------------------------------------------------------------


def serve(model: str, flags: list[str], layers: int | None = None) -> int:
    """The server process: `loraplex serve` with `flags`, on a random model of the 8B shape for `8b` (its first
    `layers` layers when given)."""
    from loraplex import cli

    args = cli.build_parser().parse_args(["serve", *flags])
    if model == "default":
        return cli.main(["serve", *flags])
    from dataclasses import replace

    from benchmarks.random_models import llama_8b
    from loraplex.checkpoints.sources import resolve_model
    from loraplex.engine.engine import Engine
    from loraplex.server.logs import configure_logging
    from loraplex.tokenizer import Tokenizer

    configure_logging(False)
    sock = cli._bound_socket(args.hostname, args.port)
    try:
        tokenizer = Tokenizer.from_pretrained(str(resolve_model(None).path))
    except Exception:  # noqa: BLE001  (a machine without the embedded model's package: any small tokenizer will do)
        from tests.helpers import tiny_seq2seq_tokenizer

        tokenizer = Tokenizer(tiny_seq2seq_tokenizer("bart"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = replace(llama_8b(device, layers or SHAPES["8b"][3]), tokenizer=tokenizer)
    engine = Engine(loaded, cli._engine_config(args))
    if engine.warms_up:
        report = engine.warm_up()
        print(f"warmed up: {report.requests} requests, {report.graphs_captured} graphs, {report.seconds:.1f}s",
              file=sys.stderr, flush=True)
    return cli.serve_engine(engine, args, sock)


class Server:
    """The server subprocess, ready once it printed its ready line."""

    def __init__(self, model: str, flags: list[str], layers: int | None, ready_timeout_s: float = 900) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "benchmarks.cold_adapters", "--serve", "--model", model,
                   *(["--layers", str(layers)] if layers else []), "--",
                   "--hostname", "127.0.0.1", "--port", str(port), *flags]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            for line in self.process.stdout:
                self.log.append(line)
                if line.startswith("loraplex ready"):
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(ready_timeout_s) or self.process.poll() is not None:
            self.close()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-40:]))

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


# ---- the clients ------------------------------------------------------------------------------------------


@dataclass
class Wave:
    name: str
    requests: int
    failed: int
    seconds: float
    tokens: int
    ttft_p50_s: float
    ttft_p99_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def _stream(client, url: str, i: int, adapter: str | None, new_tokens: int) -> tuple[float | None, int, str]:
    """(TTFT in s or None if no token came, tokens generated, error)."""
    parameters = {"max_new_tokens": new_tokens, "ignore_eos_token": True, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    body = {"inputs": f"Request {i}. {PROMPT}", "parameters": parameters}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/generate_stream", json=body) as response:
        if response.status_code != 200:
            return None, 0, f"{response.status_code} {(await response.aread())[:200]!r}"
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return first, tokens, str(event["error"])[:200]
            if event.get("token") is not None:
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
    return first, tokens, "" if tokens == new_tokens else f"{tokens} of {new_tokens} tokens"


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def wave(url: str, name: str, adapters: list[str | None], new_tokens: int,
               arriving: list[str] | None = None, arrive_after_s: float = 0.0) -> tuple[Wave, Wave | None]:
    """One request per entry of `adapters`, all at once; and, when given, one request on each adapter of
    `arriving`, `arrive_after_s` later. Returns the wave's figures and the arrivals'."""
    import httpx

    limits = httpx.Limits(max_connections=len(adapters) + len(arriving or ()) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.perf_counter()
        main = [asyncio.create_task(_stream(client, url, i, a, new_tokens)) for i, a in enumerate(adapters)]
        extra = []
        if arriving:
            await asyncio.sleep(arrive_after_s)  # the arrivals' schedule, not a synchronisation
            extra = [asyncio.create_task(_stream(client, url, 1000 + i, a, new_tokens)) for i, a in enumerate(arriving)]
        results = await asyncio.gather(*main)
        main_seconds = time.perf_counter() - started
        extra_results = await asyncio.gather(*extra)

    def figures(label: str, rows, seconds: float) -> Wave:
        ttfts = [t for t, _, error in rows if t is not None and not error]
        failed = [error for _, _, error in rows if error]
        if failed:
            print(f"{label}: {len(failed)} failed, e.g. {failed[0]}", file=sys.stderr)
        return Wave(label, len(rows), len(failed), seconds, sum(n for _, n, _ in rows), _p(ttfts, 0.5), _p(ttfts, 0.99))

    return figures(name, results, main_seconds), (figures(name + " (arrivals)", extra_results, main_seconds)
                                                  if arriving else None)


def _read_seconds(path: pathlib.Path) -> float:
    started = time.perf_counter()
    with open(path, "rb") as file:
        while file.read(16 * 2**20):
            pass
    return time.perf_counter() - started


async def run(args: argparse.Namespace, root: pathlib.Path) -> dict:
    n = args.adapters
    cold, arrivals = [f"cold{k}" for k in range(n)], [f"arrival{k}" for k in range(8)]
    single, probe = "single0", "probe0"
    size = write_adapters(root, [*cold, *arrivals, single, probe], args.model, layers=args.layers)
    flags = ["--adapter-source", "local", "--adapter-root", str(root), "--max-active-adapters", str(max(32, n + 10)),
             "--max-concurrent-requests", str(4 * args.clients), *args.server_flags]
    server = Server(args.model, flags, args.layers)
    try:
        url, clients, new = server.url, args.clients, args.new_tokens
        await wave(url, "warm-up", [None] * 8, 8)
        waves = {}
        waves["base"], _ = await wave(url, "base", [None] * clients, new)
        waves["cold"], _ = await wave(url, "cold", [cold[i % n] for i in range(clients)], new)
        waves["warm"], _ = await wave(url, "warm", [cold[i % n] for i in range(clients)], new)
        waves["one base"], _ = await wave(url, "one base", [None], new)
        waves["one warm"], _ = await wave(url, "one warm", [cold[0]], new)
        waves["one cold"], _ = await wave(url, "one cold", [single], new)
        read_s = _read_seconds(root / probe / "adapter_model.safetensors")
        waves["warm again"], _ = await wave(url, "warm again", [cold[i % n] for i in range(clients)], new)
        waves["warm + 8 cold"], waves["8 cold arrivals"] = await wave(
            url, "warm + 8 cold", [cold[i % n] for i in range(clients)], new, arriving=arrivals,
            arrive_after_s=args.arrive_after_s)
    finally:
        server.close()
    table = {name: {**asdict(w), "tokens_per_s": w.tokens_per_s} for name, w in waves.items()}
    one_cold, one_base = waves["one cold"].ttft_p50_s, waves["one base"].ttft_p50_s
    return {
        "model": args.model + (f" ({args.layers} layers)" if args.layers else ""), "clients": clients, "new_tokens": new, "adapters": n, "adapter_bytes": size,
        "read_adapter_s": read_s, "waves": table,
        "cold_over_warm_tok_s": waves["cold"].tokens_per_s / waves["warm"].tokens_per_s,
        "warm_p99_with_arrivals_over_without": waves["warm + 8 cold"].ttft_p99_s / waves["warm again"].ttft_p99_s,
        "one_cold_ttft_over_read_plus_prefill": one_cold / (read_s + one_base),
        "load_average": os.getloadavg(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def report(result: dict) -> str:
    lines = [f"{result['model']}: {result['clients']} clients x {result['new_tokens']} new tokens, "
             f"{result['adapters']} adapters of {result['adapter_bytes'] / 2**20:.0f} MiB (read cold in "
             f"{result['read_adapter_s']:.3f}s), on {result['device']}, load {result['load_average'][0]:.1f}",
             "| wave | requests | failed | tok/s | TTFT p50 | TTFT p99 |", "|---|---:|---:|---:|---:|---:|"]
    for name, w in result["waves"].items():
        lines.append(f"| {name} | {w['requests']} | {w['failed']} | {w['tokens_per_s']:,.0f} | "
                     f"{w['ttft_p50_s']:.3f} s | {w['ttft_p99_s']:.3f} s |")
    lines += [f"cold / warm throughput: {result['cold_over_warm_tok_s']:.2f}x (target >= 0.8x)",
              f"warm TTFT p99 with 8 cold arrivals / without: {result['warm_p99_with_arrivals_over_without']:.2f}x "
              "(target <= 1.2x)",
              f"one cold adapter's TTFT / (read + one base TTFT): {result['one_cold_ttft_over_read_plus_prefill']:.2f}x "
              "(target <= 2x)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="default")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--layers", type=int, help="8b: only the first LAYERS layers (a smaller run)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--arrive-after-s", type=float, default=0.5,
                        help="when the 8 cold arrivals come, after the warm wave starts")
    parser.add_argument("--work", help="where the adapters are written (default: a temporary directory)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("server_flags", nargs="*", help="after --: more `loraplex serve` flags")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.model, args.server_flags, args.layers)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        result = asyncio.run(run(args, pathlib.Path(work)))
    print(report(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
