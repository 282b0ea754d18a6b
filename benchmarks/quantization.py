"""Quantized serving on the Llama-3.1-8B shape, through loraplex's Engine: `python -m benchmarks.quantization`.

A random-weight model of Llama-3.1-8B's shape (vocabulary cut to 49152 unless --vocab; hidden 4096, 32 layers,
32 heads, 8 KV heads, intermediate 14336) is built once per setting and runs greedy workloads (128 prompt / 64 new
tokens a request, EOS ignored) of R requests over A random rank-16 adapters (`--workloads 1x0,32x0,64x0,64x8,64x64`),
CUDA graphs on as served:

    bf16     the float model (bfloat16 on CUDA)              int8     --quantize bitsandbytes (weight-only on CUDA)
    nf4      --quantize bitsandbytes-nf4                     fp8      --quantize fp8 (e4m3 weights, per channel)
    fp8-kv8  --quantize fp8 --kv-cache-dtype fp8             w4a16    4-bit weights in groups of 128 (round to
                                                                      nearest), the layer GPTQ/AWQ checkpoints load into

    python -m benchmarks.quantization                                   # CUDA, the 8B shape, every setting
    python -m benchmarks.quantization --settings bf16,fp8 --layers 8   # fewer (faster, less memory)
    OMP_NUM_THREADS=1 python -m benchmarks.quantization --device cpu --layers 2 --hidden 256 --heads 4 \\
        --kv-heads 2 --intermediate 512 --vocab 1024 --workloads 1x0,4x2 --new-tokens 8 --settings bf16,fp8  # CPU smoke

Printed per setting: the weights' bytes (`loraplex.quantization.weight_bytes`: parameters, buffers, quantization
statistics), the KV cache capacity in tokens the engine would size with its defaults once the model is loaded, and
per workload the decode tokens/s (every token after each request's first, over the decode steps' time), with the
ratio to bf16's same workload; at one request also the roofline for that setting's bytes (benchmarks/roofline.py:
weights read once a step, an untied embedding's rows only, plus the KV cache at the average context, at the measured
copy bandwidth) and the share of it reached.

On CUDA `--quantize bitsandbytes` multiplies bitsandbytes' int8 weights weight-only (bnb/layers.py), CUDA graphs on;
elsewhere it is LLM.int8, which decodes without graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from benchmarks.progress import progress
from benchmarks.roofline import average_decode_context, copy_bandwidth, kv_bytes_per_token
from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel, build_model
from loraplex.engine.memory import kv_cache_blocks
from loraplex.models.registry import config_from_hf, model_class
from loraplex.params import SamplingParams
from loraplex.quantization import check_quantize, quantize_model, weight_bytes

GiB = 2**30


@dataclass(frozen=True)
class Setting:
    quantize: str | None = None  # a --quantize mode
    kv_cache_dtype: str = "auto"
    w4a16_group: int | None = None  # 4-bit weight-only, this group size


SETTINGS = {
    "bf16": Setting(),
    "int8": Setting("bitsandbytes"),
    "nf4": Setting("bitsandbytes-nf4"),
    "fp8": Setting("fp8"),
    "fp8-kv8": Setting("fp8", kv_cache_dtype="fp8"),
    "w4a16": Setting(w4a16_group=128),
}


@dataclass
class Workload:
    requests: int
    adapters: int
    decode_tokens_per_s: float = 0.0
    roofline_tokens_per_s: float | None = None  # one request only


@dataclass
class Result:
    setting: str
    weight_bytes: int
    kv_capacity_tokens: int
    load_s: float
    workloads: list[Workload] = field(default_factory=list)


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
    """Our model built as load_model builds it, from a state dict of random tensors made on `device`."""
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


def quantized_model(config: ModelConfig, setting: Setting, device: torch.device, dtype: torch.dtype, seed: int):
    if setting.quantize is not None:
        check_quantize(setting.quantize, device, dtype)
    # Drawn on the device (drawing 8B numbers on the host takes minutes); the float weights go as each linear is
    # quantized.
    quantizing = setting.quantize is not None or setting.w4a16_group is not None
    model = random_model(config, device, dtype, seed)
    if setting.quantize is not None:
        quantize_model(model, setting.quantize, device, dtype)
    if setting.w4a16_group is not None:
        _round_to_w4a16(model, device, dtype, setting.w4a16_group)
    if quantizing:
        from loraplex.quantization import move_unquantized

        move_unquantized(model, device)
    return model


def _round_to_w4a16(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, group_size: int) -> None:
    """Every linear --quantize would quantize, as the W4A16 layer GPTQ/AWQ checkpoints load into (rounded to
    nearest: the kernels' speed does not depend on how the integers were chosen)."""
    from loraplex.quantization import default_skip
    from loraplex.quantization.w4a16.mode import W4A16Linear

    skip = default_skip(model)
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and not skip(n)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, W4A16Linear.from_float(getattr(owner, child), group_size, device=device, dtype=dtype))


def step_weight_bytes(model: torch.nn.Module, config: ModelConfig, rows: int) -> int:
    """Weight bytes a decode step reads: everything once, but an untied embedding table only at its rows."""
    embed = model.get_submodule("model.embed_tokens").weight
    total = weight_bytes(model)
    if not config.tie_word_embeddings:
        total -= embed.numel() * embed.element_size() - min(rows, embed.shape[0]) * embed.shape[1] * embed.element_size()
    return total


def run_setting(args, config: ModelConfig, name: str, device: torch.device, dtype: torch.dtype, bandwidth,
                log=None) -> Result:
    log = log or progress()
    log(f"{name}: building and quantizing the model")
    setting = SETTINGS[name]
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    started = time.perf_counter()
    model = quantized_model(config, setting, device, dtype, args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - started
    loaded = LoadedModel(model, config, None, device, dtype, f"random-llama-{name}")
    workloads = [Workload(*map(int, w.split("x"))) for w in args.workloads.split(",")]
    most_requests = max(w.requests for w in workloads)
    most_adapters = max(w.adapters for w in workloads)
    per_request = args.prompt_len + args.new_tokens
    served = EngineConfig(device=str(device), kv_cache_dtype=setting.kv_cache_dtype, max_input_length=args.prompt_len,
                          max_total_tokens=per_request, max_num_seqs=most_requests,
                          max_active_adapters=max(1, most_adapters))
    capacity = kv_cache_blocks(served, loaded) * served.block_size  # what serving with the defaults would hold
    engine = Engine(loaded, replace(served, max_batch_total_tokens=most_requests * (per_request + 16),
                                    max_batch_prefill_tokens=args.max_batch_prefill_tokens))
    result = Result(name, weight_bytes(model), capacity, load_s)
    made = []
    if most_adapters:
        from benchmarks.adapters import AdapterSpec, random_adapter

        made = [random_adapter(f"a{i}", engine.lora.base_shapes, AdapterSpec(), 64, seed=i) for i in range(most_adapters)]
    rng = random.Random(args.seed)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    kv_dtype = torch.float8_e4m3fn if setting.kv_cache_dtype == "fp8" else dtype
    for work in workloads:
        log(f"{name} {work.requests}x{work.adapters}: untimed run, then {args.repeats} timed")
        prompts = [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)] for _ in range(work.requests)]
        adapters = [made[i % work.adapters] if work.adapters else None for i in range(work.requests)]
        engine.generate(prompts, params, adapters=adapters)  # untimed: captures this workload's graphs
        decode_s, tokens = min((timed_decode(engine, prompts, params, adapters, device) for _ in range(args.repeats)),
                               key=lambda run: run[0] / run[1])
        work.decode_tokens_per_s = tokens / decode_s
        if work.requests == 1:
            kv = kv_bytes_per_token(config, kv_dtype) * average_decode_context(args.prompt_len, args.new_tokens)
            work.roofline_tokens_per_s = bandwidth.bytes_per_s / (step_weight_bytes(model, config, 1) + kv)
        result.workloads.append(work)
        print(f"{name} {work.requests}x{work.adapters}: {work.decode_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    del engine, model, loaded
    return result


def timed_decode(engine: Engine, prompts, params, adapters, device) -> tuple[float, int]:
    """(seconds after every request has its first token, tokens generated in them)."""
    requests = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    pending = {r.request_id for r in requests}
    prefilled_at, tokens = None, 0
    while engine.has_unfinished:
        outputs = engine.step()
        if prefilled_at is not None:
            tokens += len(outputs)
        pending -= {o.request_id for o in outputs}
        if prefilled_at is None and not pending:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prefilled_at = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - prefilled_at, tokens


def format_table(results: list[Result], args, device: torch.device, dtype: torch.dtype, bandwidth) -> str:
    shape = (f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV, "
             f"intermediate {args.intermediate}, vocab {args.vocab}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"random Llama ({shape}), {str(dtype).removeprefix('torch.')} compute on {name}; "
             f"{args.prompt_len} prompt / {args.new_tokens} new tokens a request, greedy; workloads RxA: R requests over "
             f"A rank-16 adapters; bandwidth {bandwidth.describe()}", ""]
    base = next((r for r in results if r.setting == "bf16"), None)
    works = [f"{w.requests}x{w.adapters}" for w in results[0].workloads]
    lines.append("| setting | weights GiB | KV capacity tokens | " + " | ".join(f"{w} tok/s" for w in works)
                 + " | 1 request vs roofline |")
    lines.append("|---|---:|---:|" + "---:|" * len(works) + "---:|")
    for r in results:
        cells = []
        for i, w in enumerate(r.workloads):
            ratio = f" ({w.decode_tokens_per_s / base.workloads[i].decode_tokens_per_s:.2f}x)" if base and r is not base else ""
            cells.append(f"{w.decode_tokens_per_s:.1f}{ratio}")
        one = next((w for w in r.workloads if w.roofline_tokens_per_s), None)
        roof = f"{one.decode_tokens_per_s / one.roofline_tokens_per_s:.1%} of {one.roofline_tokens_per_s:.0f}" if one else "-"
        lines.append(f"| {r.setting} | {r.weight_bytes / GiB:.2f} | {r.kv_capacity_tokens} | " + " | ".join(cells)
                     + f" | {roof} |")
    lines.append("")
    lines.append("(x): the ratio to bf16's decode tokens/s on the same workload, in this run.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantization", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--workloads", default="1x0,32x0,64x0,64x8,64x64",
                   help="comma-separated RxA: R requests over A random adapters (A=0: the base model)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-batch-prefill-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per workload (after one untimed run); the best")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        print(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    log = progress()
    log(f"quantization settings {','.join(settings)}, workloads {args.workloads}, a random Llama of {args.layers} layers "
        f"(hidden {args.hidden}) on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
        "(the 8B shape: minutes a setting on a GPU, far longer on a CPU)")
    config = llama_config(args)
    log("measuring the copy bandwidth")
    bandwidth = copy_bandwidth(device)
    results = [run_setting(args, config, s, device, dtype, bandwidth, log) for s in settings]
    print(format_table(results, args, device, dtype, bandwidth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bandwidth": bandwidth.to_json(), "results": [asdict(r) for r in results]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
