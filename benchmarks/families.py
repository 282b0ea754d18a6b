"""Decode of the Llama family's variants at their published shapes, against the bandwidth roofline of the bytes a
step reads: `python -m benchmarks.families`.

Each family is its hub config.json as published (tests/models/hub_configs.py: vocabulary and all; Mixtral with its
layer count cut to `--moe-layers` so that it fits beside its transformers twin), random bf16 weights drawn on the
device, served by the Engine with CUDA graphs as `loraplex serve` does. Workloads RxA: R requests of 128 prompt /
64 new tokens over A random rank-16 adapters on every projection (q/k/v/o and the MLP's; on a mixture of experts the
attention's), greedy, EOS ignored; decode tokens/s counts every token after each request's first.

The roofline at one request (benchmarks/roofline.py's conventions) reads every weight once, an untied embedding only
at its row, and of each mixture of experts only the top-k experts the row is routed to (what a step actually reads),
plus the KV cache at the average context, at the measured copy bandwidth.

With `--peers` the mixtures of experts also run transformers' batched `generate` on the same weights (32 requests,
base model) and PEFT's mixed-adapter batch (32 requests over 8 adapters on the attention projections, the same
adapters loraplex serves): end-to-end generated tokens/s of each (prefill included, as `generate` cannot separate it).

    python -m benchmarks.families --peers                  # the H200 run of docs/benchmarks.md
    python -m benchmarks.families --device cpu --shrink --peers --requests 1,4 --adapters 2 --new-tokens 8  # smoke
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from benchmarks.adapters import AdapterSpec, adapter_from_peft, make_peft_model, random_adapter
from benchmarks.peers import left_padded
from benchmarks.progress import progress
from benchmarks.quantization import random_model, step_weight_bytes, timed_decode
from benchmarks.roofline import average_decode_context, copy_bandwidth, kv_bytes_per_token
from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel, build_model
from loraplex.layers.moe import MoeExperts
from loraplex.models.registry import config_from_hf
from loraplex.params import SamplingParams
from loraplex.quantization import weight_bytes
from tests.models.hub_configs import HUB_CONFIGS, shrunk

GiB = 2**30
FAMILIES = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "gemma-2-9b": "google/gemma-2-9b",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Run:
    requests: int
    adapters: int
    tokens_per_s: float = 0.0


@dataclass
class FamilyResult:
    name: str
    layers: int
    weight_gib: float
    step_gib: float  # what a one-request step reads (weights and KV)
    roofline_tokens_per_s: float
    runs: list[Run] = field(default_factory=list)
    peers: dict[str, float] = field(default_factory=dict)  # name -> end-to-end tokens/s (and loraplex's own)


def published(name: str, moe_layers: int, shrink: bool = False) -> dict:
    hf = shrunk(HUB_CONFIGS[FAMILIES[name]]) if shrink else dict(HUB_CONFIGS[FAMILIES[name]])
    if hf["model_type"] in ("mixtral", "qwen2_moe"):
        hf["num_hidden_layers"] = min(moe_layers, hf["num_hidden_layers"])
    return hf


def expert_bytes_unread(model: torch.nn.Module, config: ModelConfig) -> int:
    """Bytes of the experts a one-row step is not routed to (each layer reads top_k of its experts)."""
    unread = 0
    for module in model.modules():
        if isinstance(module, MoeExperts):
            per_expert = sum(p[0].numel() * p.element_size() for p in (module.gate_up_proj, module.down_proj))
            unread += (module.num_experts - config.moe.top_k) * per_expert
    return unread


def hf_twin(hf_config: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """transformers' model of `hf_config` with random weights (std 0.02, norms at 1) drawn on the device."""
    import transformers

    values = dict(hf_config)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def run_family(args, name: str, device: torch.device, dtype: torch.dtype, bandwidth, log=None) -> FamilyResult:
    log = log or progress()
    log(f"{name}: building the model" + (" and its transformers twin" if args.peers else ""))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf_config = published(name, args.moe_layers, args.shrink)
    config = config_from_hf(hf_config)
    moe = config.moe is not None
    twin = hf_twin(hf_config, device, dtype, args.seed) if moe and args.peers else None
    if twin is not None:  # the same weights as the peers (our loader stacks and fuses from transformers' state)
        model = build_model(config, dict(twin.state_dict()))
    else:
        model = random_model(config, device, dtype, args.seed)
    loaded = LoadedModel(model, config, None, device, dtype, f"random-{name}")
    per_request = args.prompt_len + args.new_tokens
    most = max(args.requests)
    engine = Engine(loaded, EngineConfig(
        device=str(device), max_input_length=args.prompt_len, max_total_tokens=per_request, max_num_seqs=most,
        max_active_adapters=args.adapters, max_batch_total_tokens=most * (per_request + 16),
        max_batch_prefill_tokens=8192))
    spec = AdapterSpec(targets=ATTENTION if moe else AdapterSpec().targets)
    peft = None
    if twin is not None:
        names = [f"a{i}" for i in range(args.adapters)]
        peft = make_peft_model(twin, names, spec, seed=args.seed)
        made = [adapter_from_peft(peft, n, engine.lora.base_shapes, 64) for n in names]
    else:
        made = [random_adapter(f"a{i}", engine.lora.base_shapes, spec, 64, seed=i) for i in range(args.adapters)]

    kv = kv_bytes_per_token(config, dtype) * average_decode_context(args.prompt_len, args.new_tokens)
    step = step_weight_bytes(model, config, 1) - (expert_bytes_unread(model, config) if moe else 0) + kv
    result = FamilyResult(name, config.num_layers, weight_bytes(model) / GiB, step / GiB, bandwidth.bytes_per_s / step)
    rng = random.Random(args.seed)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)] for _ in range(most)]
    for requests in args.requests:
        for adapters in sorted({0, args.adapters}):
            if requests == 1 and adapters > 1:
                continue
            log(f"{name} {requests}x{adapters}: untimed run, then {args.repeats} timed")
            rows = prompts[:requests]
            chosen = [made[i % adapters] if adapters else None for i in range(requests)]
            engine.generate(rows, params, adapters=chosen)  # untimed: captures this workload's graphs
            seconds, tokens = min((timed_decode(engine, rows, params, chosen, device) for _ in range(args.repeats)),
                                  key=lambda r: r[0] / r[1])
            result.runs.append(Run(requests, adapters, tokens / seconds))
            print(f"{name} {requests}x{adapters}: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    if args.profile:
        print(kernel_profile(loaded, engine.config, prompts[:1], params), file=sys.stderr, flush=True)
    if twin is not None:
        log(f"{name}: loraplex, transformers and PEFT end to end ({args.peer_requests} requests)")
        result.peers = peer_rates(args, engine, twin, peft, made, prompts[:args.peer_requests], params, device)
    del engine, model, loaded, twin, peft
    return result


def kernel_profile(loaded, engine_config: EngineConfig, prompts, params, top: int = 15) -> str:
    """Where a one-request decode's GPU time goes, kernel by kernel (eagerly: the profiler sees no kernel inside a
    replayed graph; the kernels are the same)."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(loaded, replace(engine_config, cuda_graphs=False))
    engine.generate(prompts, params)
    activities = [ProfilerActivity.CUDA] if loaded.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        engine.generate(prompts, params)
    return f"{loaded.model_id}, one request, eager:\n" + prof.key_averages().table(sort_by="cuda_time_total" if loaded.device.type == "cuda" else "cpu_time_total", row_limit=top)


def peer_rates(args, engine, twin, peft, made, prompts, params, device) -> dict[str, float]:
    """End-to-end generated tokens/s: loraplex and transformers on the base model, loraplex and PEFT mixed."""
    adapter_names = [made[i % len(made)].adapter_id for i in range(len(prompts))]
    chosen = [made[i % len(made)] for i in range(len(prompts))]
    input_ids, mask = left_padded(prompts, 0)
    input_ids, mask = input_ids.to(device), mask.to(device)

    def ours(adapters):
        return lambda: engine.generate(prompts, params, adapters=adapters)

    def theirs(model, **kw):
        return lambda: model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens,
                                      pad_token_id=0, temperature=None, top_p=None, top_k=None, **kw)

    rates = {}
    with peft.disable_adapter():
        base_peer = theirs(peft)
        rates["loraplex base"] = _rate(ours([None] * len(prompts)), len(prompts) * params.max_new_tokens, device)
        rates["transformers batched base"] = _rate(base_peer, len(prompts) * params.max_new_tokens, device)
    rates[f"loraplex {len(made)} adapters"] = _rate(ours(chosen), len(prompts) * params.max_new_tokens, device)
    rates[f"PEFT mixed {len(made)} adapters"] = _rate(theirs(peft, adapter_names=adapter_names),
                                                      len(prompts) * params.max_new_tokens, device)
    return rates


def _rate(call, tokens: int, device: torch.device) -> float:
    call()  # warm-up (graphs, autotuning)
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return tokens / (time.perf_counter() - started)


def format_table(results: list[FamilyResult], args, device, dtype, bandwidth) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"published shapes, random {str(dtype).removeprefix('torch.')} weights on {gpu}; {args.prompt_len} prompt / {args.new_tokens} new tokens "
             f"a request; RxA: R requests over A rank-16 adapters; bandwidth {bandwidth.describe()}", ""]
    heads = [f"{r.requests}x{r.adapters}" for r in results[0].runs]
    lines.append("| family | layers | weights GiB | 1-row step GiB | roofline tok/s | " + " | ".join(heads)
                 + " | 1 request vs roofline |")
    lines.append("|---|---:|---:|---:|---:|" + "---:|" * len(heads) + "---:|")
    for r in results:
        one = next(run for run in r.runs if run.requests == 1)
        cells = [f"{run.tokens_per_s:.1f}" for run in r.runs]
        lines.append(f"| {r.name} | {r.layers} | {r.weight_gib:.2f} | {r.step_gib:.2f} | {r.roofline_tokens_per_s:.0f} | "
                     + " | ".join(cells) + f" | {one.tokens_per_s / r.roofline_tokens_per_s:.1%} |")
    for r in results:
        if r.peers:
            lines += ["", f"{r.name}, {args.peer_requests} requests, end-to-end generated tok/s:"]
            lines += [f"  {peer}: {rate:.1f}" for peer, rate in r.peers.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", default="1,8,32", help="comma-separated request counts")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--moe-layers", type=int, default=8, help="layers kept of a mixture-of-experts config")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peers", action="store_true", help="transformers and PEFT on the mixtures of experts")
    p.add_argument("--peer-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also one request's kernels by GPU time (eager)")
    p.add_argument("--shrink", action="store_true", help="the configs' tiny versions (a CPU smoke run)")
    args = p.parse_args(argv)
    args.requests = [int(r) for r in args.requests.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    log(f"families {args.families} at {'shrunk' if args.shrink else 'published'} shapes on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, workloads "
        f"{','.join(map(str, args.requests))} requests x {{0, {args.adapters}}} adapters"
        + (" (a smoke run: minutes)" if args.shrink else " (published shapes: tens of minutes on a GPU)"))
    log("measuring the copy bandwidth")
    bandwidth = copy_bandwidth(device)
    results = [run_family(args, name, device, dtype, bandwidth, log) for name in args.families.split(",")]
    print(format_table(results, args, device, dtype, bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
