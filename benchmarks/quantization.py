"""Weight memory and decode speed of --quantize, through loraplex's Engine: `python -m benchmarks.quantization`.

A random-weight model of Llama-3.1-8B's shape (vocabulary cut to 49152; hidden 4096, 32 layers, 32 heads, 8 KV
heads, intermediate 14336) is built once per setting, in the base dtype (bfloat16 on CUDA) and with each
bitsandbytes mode, and runs the same greedy workload (32 requests x 128 prompt / 64 new tokens, EOS ignored):

    python -m benchmarks.quantization                                   # CUDA, the 8B shape
    python -m benchmarks.quantization --layers 8                        # fewer layers (faster, less memory)
    OMP_NUM_THREADS=1 python -m benchmarks.quantization --device cpu --layers 2 --hidden 256 --heads 4 \\
        --kv-heads 2 --intermediate 512 --vocab 1024 --requests 4 --prompt-len 32 --new-tokens 8   # CPU smoke run
    (one thread: on a shared CPU, intra-op threads spin-waiting for a busy core make tiny timings erratic)

Printed as a markdown table, per setting: the weights' bytes (parameters, buffers and quantization statistics,
`loraplex.quantization.weight_bytes`), on CUDA also the memory allocated once the model is ready and the peak
while building and quantizing it (`torch.cuda.max_memory_allocated`), then prefill time (all prompts, one
engine step when they fit `--max-batch-prefill-tokens`), decode tokens/s (every token after each request's
first, over the decode steps' time) and overall output tokens/s. With `--adapters N` every request runs on one
of N random rank-16 adapters (LoRA on top of the quantized linears).

Random weights (std 0.02) have no outlier features: LLM.int8 (`bitsandbytes`) then never takes its mixed
int8/float path, which real checkpoints take on a few columns; its speed here is the int8 path alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

from loraplex.config import EngineConfig, ModelConfig
from loraplex.models.registry import config_from_hf
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel, build_model
from loraplex.models.registry import model_class
from loraplex.params import SamplingParams
from loraplex.quantization import QUANTIZE_CHOICES, check_quantize, quantize_model, weight_bytes

GiB = 2**30


@dataclass
class Result:
    setting: str
    weight_bytes: int
    allocated_bytes: int | None  # CUDA: allocated once the model is ready (before the KV cache)
    peak_bytes: int | None  # CUDA: the most allocated while building and quantizing
    load_s: float
    prefill_s: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    output_tokens: int


def llama_config(args: argparse.Namespace) -> ModelConfig:
    """Llama-3.1-8B's config.json values (but the vocabulary and any size given)."""
    return config_from_hf({
        "model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": 2,
    })


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Our model built as load_model builds it, from a state dict of random tensors made on the device."""
    with torch.device("meta"):
        tensors = model_class(config)(config).state_dict(keep_vars=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    state, drawn = {}, {}
    for name, tensor in tensors.items():  # (no autograd: load_into assigns these tensors as the parameters)
        if id(tensor) in drawn:  # a tied head: the embedding's tensor again (else build_model unties it)
            state[name] = drawn[id(tensor)]
            continue
        shape = tuple(tensor.shape)
        if len(shape) >= 2:  # matrices and embeddings: std 0.02 (transformers' init)
            state[name] = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        else:  # norm weights
            state[name] = torch.ones(shape, device=device, dtype=dtype)
        drawn[id(tensor)] = state[name]
    return build_model(config, state)


def run_setting(args, config: ModelConfig, setting: str, device: torch.device, dtype: torch.dtype) -> Result:
    mode = None if setting == "base" else setting
    if mode is not None:
        check_quantize(mode, device, dtype)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    model = random_model(config, device, dtype, args.seed)
    if mode is not None:
        quantize_model(model, mode, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - started
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    wbytes = weight_bytes(model)

    tokens = args.requests * (args.prompt_len + args.new_tokens)
    engine = Engine(
        LoadedModel(model, config, None, device, dtype, f"random-llama-{setting}"),
        EngineConfig(
            device=str(device), max_batch_total_tokens=tokens + 16 * args.requests,
            max_batch_prefill_tokens=args.max_batch_prefill_tokens, max_num_seqs=args.requests,
            max_input_length=args.prompt_len, max_total_tokens=args.prompt_len + args.new_tokens,
            max_active_adapters=max(1, args.adapters),
        ),
    )
    adapters = [None] * args.requests
    if args.adapters:
        from benchmarks.adapters import AdapterSpec, random_adapter

        made = [random_adapter(f"a{i}", engine.lora.base_shapes, AdapterSpec(), 64, seed=i) for i in range(args.adapters)]
        adapters = [made[i % len(made)] for i in range(args.requests)]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    engine.generate(prompts, params, adapters=adapters)  # warm-up: the same run, untimed
    runs = [_timed_run(engine, prompts, params, adapters, device) for _ in range(args.repeats)]
    prefill_s, decode_s, output_tokens = min(runs, key=lambda run: run[0] + run[1])
    decode_tokens = output_tokens - args.requests
    result = Result(
        setting, wbytes, allocated, peak, load_s, prefill_s,
        decode_tokens / decode_s if decode_s > 0 else float("nan"), output_tokens / (prefill_s + decode_s), output_tokens,
    )
    del engine, model
    return result


def _timed_run(engine: Engine, prompts, params, adapters, device) -> tuple[float, float, int]:
    """(seconds until every request has its first token, seconds after that, tokens generated)."""
    requests = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    pending = {r.request_id for r in requests}
    started = time.perf_counter()
    prefilled_at = None
    tokens = 0
    while engine.has_unfinished:
        outputs = engine.step()
        tokens += len(outputs)
        pending -= {o.request_id for o in outputs}
        if prefilled_at is None and not pending:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prefilled_at = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ended = time.perf_counter()
    return prefilled_at - started, ended - prefilled_at, tokens


def format_table(results: list[Result], args, device: torch.device, dtype: torch.dtype) -> str:
    base = next((r for r in results if r.setting == "base"), None)
    shape = (f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV, "
             f"intermediate {args.intermediate}, vocab {args.vocab}")
    work = f"{args.requests} requests x {args.prompt_len} prompt / {args.new_tokens} new tokens, greedy"
    if args.adapters:
        work += f", {args.adapters} random rank-16 adapters"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"random Llama ({shape}), {str(dtype).removeprefix('torch.')} compute on {name}; {work}",
        "",
    ]

    unit, size = ("GiB", GiB) if max(r.weight_bytes for r in results) >= GiB else ("MiB", 2**20)

    def gib(value: int | None) -> str:
        return "-" if value is None else f"{value / size:.2f}"

    lines += [
        f"| setting | weights {unit} | vs base | allocated {unit} | peak {unit} | prefill s | decode tok/s | vs base "
        "| output tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mem_ratio = f"{r.weight_bytes / base.weight_bytes:.2f}x" if base else "-"
        speed_ratio = f"{r.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x" if base else "-"
        label = "base" if r.setting == "base" else r.setting
        lines.append(
            f"| {label} | {gib(r.weight_bytes)} | {mem_ratio} | {gib(r.allocated_bytes)} | {gib(r.peak_bytes)} | "
            f"{r.prefill_s:.2f} | {r.decode_tokens_per_s:.1f} | {speed_ratio} | {r.output_tokens_per_s:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantization", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--settings", default=",".join(("base", *QUANTIZE_CHOICES[:2])),
                   help=f"comma-separated: base and any of {', '.join(QUANTIZE_CHOICES)} (default: base, 8-bit, nf4)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-batch-prefill-tokens", type=int, default=4096)
    p.add_argument("--adapters", type=int, default=0, help="random rank-16 adapters the requests spread over (0: none)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting (after one warm-up run); the best is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s != "base" and s not in QUANTIZE_CHOICES]
    if unknown:
        print(f"unknown settings {unknown}; choose from base, {', '.join(QUANTIZE_CHOICES)}", file=sys.stderr)
        return 2
    config = llama_config(args)
    results = []
    for setting in settings:
        results.append(run_setting(args, config, setting, device, dtype))
        print(f"{setting}: done", file=sys.stderr, flush=True)
    print(format_table(results, args, device, dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
