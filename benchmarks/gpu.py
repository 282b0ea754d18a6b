"""GPU benchmark (issue 13, item 5): loraplex as it is today, on random-weight models of real shapes, against
transformers and PEFT on the same weights, and against the memory-bandwidth roofline. `python -m benchmarks.gpu`.

Workloads (`--workloads`, comma-separated; default all five):

- `135m`: SmolLM2-135M's shape, 64 requests x 256 prompt / 128 new tokens, round-robin over 8 adapters;
- `8b`: Llama-3.1-8B's shape (vocabulary cut to 49,152), 32 requests x 256 / 64, over 8 adapters;
- `8b-single`: the 8B shape, one request, 256 / 128 (one adapter for the adapter systems); its decode rate
  against the roofline is the headline figure (target 70%);
- `8b-64`: the 8B shape, 64 requests x 1,000 / 64 over 64 distinct adapters (about 1k context while decoding):
  loraplex with and without adapters only (the peers would take minutes here), adapters drawn at random;
- `online`: S-LoRA-style (benchmarks/online.py): Poisson arrivals at `--rate` req/s for `--duration` s (or
  `--requests N`), each request's adapter drawn from a power law (`--zipf-alpha`) over `--num-adapters` random
  adapters, prompt and output lengths uniform in `--prompt-lens` / `--output-lens`; loraplex only, with
  adapters and without (the same arrivals and prompts), on `--online-model` (8b or 135m).

The fixed workloads run four systems on the same prompts (random token ids), greedy, EOS ignored, each warmed up
on a small run first (excluded): loraplex with adapters, loraplex without, transformers batched (one left-padded
`generate`) and PEFT's mixed-adapter batch (`adapter_names`), the adapters made with PEFT (rank 16, alpha 32, on
all seven projections) and converted, so both sides run the same adapter weights. transformers and PEFT run a
LlamaForCausalLM built from the same config holding our model's weights (a copy per peer). Reported: output
tokens/s (all tokens over the whole run) and its ratios; for loraplex also time to the last first token (prefill,
all prompts in one step) and decode tokens/s (tokens after each request's first, over the time after that),
against the roofline of benchmarks/roofline.py at the decode's average context. Prefix caching is off in the
engines (a repeat would otherwise reuse its own prompts' blocks). The online engine warms up before timing
(`Engine.warm_up`: every decode graph captured) and runs the timed workload once per system untimed; with
`--repeats` its three systems take turns, each keeping its shortest run, and each round's ratios of the adapter system to the
others are given with their median (runs close in time: steadier than the best runs' ratio on a host whose speed
drifts); `--profile DIR` writes each of its timed runs' cProfile stats there, and `--trace DIR` adds an untimed
run per system with a window of its steps traced (benchmarks/step_trace.py: each step kind's host time, CUDA calls
and kernels).

On the H200 (bf16; the device's copy bandwidth is measured first):

    python -m benchmarks.gpu --workloads 135m --json 135m.json
    python -m benchmarks.gpu --workloads 8b --json 8b.json
    python -m benchmarks.gpu --workloads 8b-single --json 8b-single.json
    python -m benchmarks.gpu --workloads online --rate 4 --duration 60 --num-adapters 64 --json online.json
    python -m benchmarks.gpu --workloads 135m,8b,8b-single,online --repeats 2 --json gpu.json   # all in one run

`--layers N` gives the 8B shape fewer layers; `--smoke` runs every workload on CPU with tiny shapes and few
tokens (the unit test's setting: tests/unit/test_bench_gpu_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import json
import os
import sys
from dataclasses import dataclass
from time import perf_counter

import torch

from benchmarks import roofline
from benchmarks.adapters import AdapterSpec, PEFTMixed, adapter_from_peft, make_peft_model, random_adapter
from benchmarks.gpu_models import OnDevice, build_model, hf_twin
from benchmarks.online import OnlineResult, format_online, online_workload, run_online
from benchmarks.peers import HFBatched
from benchmarks.progress import progress
from benchmarks.step_trace import StepTracer, describe_trace
from benchmarks.systems import Loraplex, Measurement, measure
from benchmarks.workload import Workload, equal_workload, round_robin
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel
from loraplex.server.heap import freeze_start_up_heap

WORKLOADS = ("135m", "8b", "8b-single", "8b-64", "online")
ROOFLINE_TARGET = 0.70  # 8b-single and 8b-64: decode tokens/s as a fraction of the roofline
ADAPTERS_VS_BASE_TARGET = 0.90  # 8b-64: decode tokens/s with 64 adapters over the same requests without


@dataclass(frozen=True)
class Fixed:
    model: str  # "135m" | "8b"
    requests: int
    prompt_len: int
    new_tokens: int
    adapters: int
    peers: bool = True  # also transformers batched and PEFT mixed (else loraplex alone, with random adapters)


FIXED = {"135m": Fixed("135m", 64, 256, 128, 8), "8b": Fixed("8b", 32, 256, 64, 8),
         "8b-single": Fixed("8b", 1, 256, 128, 1), "8b-64": Fixed("8b", 64, 1000, 64, 64, peers=False)}
SMOKE_FIXED = {"135m": Fixed("135m", 4, 16, 6, 2), "8b": Fixed("8b", 4, 16, 6, 2),
               "8b-single": Fixed("8b", 1, 16, 8, 1), "8b-64": Fixed("8b", 4, 24, 6, 4, peers=False)}
SPEC = AdapterSpec()  # rank 16, alpha 32, all seven projections


# ---- the systems (the models they run, and their transformers twins: benchmarks/gpu_models.py) ---------------


class PhasedLoraplex(Loraplex):
    """systems.Loraplex that also times its last run's phases: `prefill_s` (run start to the last request's first
    token) and `decode_s` (from then to the end), timed when each engine step has returned its tokens."""

    def __init__(self, engine, adapters=None, name: str = "loraplex") -> None:
        super().__init__(engine, adapters, name)
        self._step, self._first, self._last = engine.step, {}, 0.0
        engine.step = self._timed_step  # this engine only (as Loraplex observes its scheduler)
        self.phases: dict[str, float] = {}

    def _timed_step(self):
        outputs = self._step()
        self._last = perf_counter()
        for out in outputs:
            self._first.setdefault(out.request_id, self._last)
        return outputs

    def run(self, workload: Workload) -> list[list[int]]:
        self._first, started = {}, perf_counter()
        outputs = super().run(workload)
        prefilled = max(self._first.values())
        self.phases = {"prefill_s": prefilled - started, "decode_s": self._last - prefilled}
        return outputs


# ---- fixed workloads --------------------------------------------------------------------------------


@dataclass
class SystemResult:
    measurement: Measurement
    phases: dict[str, float]  # loraplex only

    def decode_tokens_per_s(self, requests: int) -> float | None:
        d = self.phases.get("decode_s")
        return (self.measurement.tokens - requests) / d if d else None


def bench_fixed(name: str, spec: Fixed, loaded: LoadedModel, peers: dict, bandwidth: roofline.Bandwidth,
                repeats: int, seed: int) -> dict:
    """Four systems on one fixed workload (two without peers); `peers` holds this model's transformers twin and
    PEFT model."""
    device, dtype, c = loaded.device, loaded.dtype, loaded.config
    names = [f"adapter-{i}" for i in range(spec.adapters)]
    total = spec.requests * (spec.prompt_len + spec.new_tokens)
    engine = Engine(loaded, EngineConfig(
        device=str(device), max_batch_total_tokens=total + 16 * (spec.requests + 8),
        max_batch_prefill_tokens=max(4096, spec.requests * spec.prompt_len), max_num_seqs=max(spec.requests, 8),
        max_input_length=spec.prompt_len, max_total_tokens=spec.prompt_len + spec.new_tokens,
        max_active_adapters=max(1, spec.adapters), max_lora_rank=SPEC.rank, prefix_caching=False,
    ))
    if spec.peers:
        adapters = {n: adapter_from_peft(peers["peft"], n, engine.lora.base_shapes, SPEC.rank) for n in names}
    else:
        adapters = {n: random_adapter(n, engine.lora.base_shapes, SPEC, SPEC.rank, seed + i) for i, n in enumerate(names)}
    workload = round_robin(equal_workload(spec.requests, c.vocab_size, (c.bos_token_id, *c.eos_token_ids),
                                          spec.prompt_len, spec.new_tokens, seed=seed), names, name=name)
    base_workload = dataclasses.replace(workload, adapter_ids=None)
    warm = equal_workload(max(2, len(names)), c.vocab_size, (), 16, 4, seed=seed + 1, name="warmup")
    warm_adapters = round_robin(warm, names)
    # loraplex warms up on the timed workload itself: a server that has run a while has captured the CUDA graphs
    # of its batch sizes (captured lazily, at a bucket's first step) and compiled its kernels. The peers (slow
    # on these workloads, with nothing to capture) warm up on a short one.
    systems = [
        (PhasedLoraplex(engine, adapters, f"loraplex, {len(names)} adapter(s)"), workload, workload),
        (PhasedLoraplex(engine, None, "loraplex, base model"), base_workload, base_workload),
    ]
    if spec.peers:
        systems += [(HFBatched(OnDevice(peers["hf"], device)), base_workload, warm),
                    (PEFTMixed(OnDevice(peers["peft"], device)), workload, warm_adapters)]
    for system, _, w in systems:
        system.run(w)
    best: list[tuple[SystemResult, list[list[int]]] | None] = [None] * len(systems)
    for _ in range(repeats):  # the systems take turns; each keeps its best run
        for i, (system, w, _) in enumerate(systems):
            m, out = measure(system, w)
            print(f"  {name}: {m.system}: {m.seconds:.2f}s", file=sys.stderr, flush=True)
            if best[i] is None or m.seconds < best[i][0].measurement.seconds:
                best[i] = (SystemResult(m, dict(getattr(system, "phases", {}))), out)
    (ours, ours_out), (base, base_out) = best[:2]

    context = spec.requests * roofline.average_decode_context(spec.prompt_len, spec.new_tokens)
    roof = {}
    for key, used in (("adapters", list(adapters.values())), ("base", [])):
        step = roofline.decode_step_bytes(loaded.model, c, dtype, spec.requests, context, used)
        roof[key] = {"bytes": dataclasses.asdict(step), "tokens_per_s": roofline.roofline_tokens_per_s(
            spec.requests, step, bandwidth)}
    keys = ("loraplex_adapters", "loraplex_base", "transformers_batched", "peft_mixed")[: len(systems)]
    result = {
        "workload": name, "description": workload.describe(), "model": loaded.model_id, "repeats": repeats,
        "dtype": str(dtype), "systems": {}, "roofline": roof,
        "ratios": {"adapters_vs_base": ours.measurement.tokens_per_s / base.measurement.tokens_per_s},
    }
    if spec.peers:
        (hf, hf_out), (peft, peft_out) = best[2:]
        result["ratios"] |= {"adapters_vs_peft": ours.measurement.tokens_per_s / peft.measurement.tokens_per_s,
                             "base_vs_transformers": base.measurement.tokens_per_s / hf.measurement.tokens_per_s}
        result["identical"] = {
            "base_vs_transformers": [sum(a == b for a, b in zip(base_out, hf_out)), spec.requests],
            "adapters_vs_peft": [sum(a == b for a, b in zip(ours_out, peft_out)), spec.requests]}
    for key, (r, _) in zip(keys, best):
        entry = vars(r.measurement) | {"tokens_per_s": r.measurement.tokens_per_s} | r.phases
        decode = r.decode_tokens_per_s(spec.requests)
        if decode is not None:
            roof_key = "adapters" if key == "loraplex_adapters" else "base"
            entry |= {"decode_tokens_per_s": decode, "roofline_fraction": decode / roof[roof_key]["tokens_per_s"]}
        result["systems"][key] = entry
    del engine, systems
    return result


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def format_fixed(r: dict, bandwidth: roofline.Bandwidth) -> str:
    lines = [f"workload {r['workload']}: {r['description']} ({SPEC.describe()}), greedy, EOS ignored, {r['model']}"
             + (f", best of {r['repeats']}" if r["repeats"] > 1 else ""), "",
             "| system | s | output tok/s | prefill s | decode tok/s | roofline tok/s | of roofline |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for key, s in r["systems"].items():
        roof = r["roofline"]["adapters" if key == "loraplex_adapters" else "base"]["tokens_per_s"]
        if "decode_tokens_per_s" in s:
            tail = (f"{s['prefill_s']:.3f} | {s['decode_tokens_per_s']:.1f} | {roof:.1f} | "
                    f"{100 * s['roofline_fraction']:.1f}% |")
        else:
            tail = "- | - | - | - |"
        lines.append(f"| {s['system']} | {s['seconds']:.2f} | {s['tokens_per_s']:.1f} | {tail}")
    q = r["ratios"]
    b = r["roofline"]["adapters"]["bytes"]
    peers = (f"loraplex+adapters / PEFT mixed = {q['adapters_vs_peft']:.2f}x; loraplex base / transformers batched "
             f"= {q['base_vs_transformers']:.2f}x; " if "identical" in r else "")
    lines += [
        "",
        f"ratios (output tok/s): {peers}loraplex+adapters / loraplex base = {q['adapters_vs_base']:.2f}x",
        f"roofline: a decode step reads weights {_size(b['weights'])} + KV {_size(b['kv'])} "
        f"(average decode context) + adapters {_size(b['adapters'])} (base: no adapters) at "
        f"{bandwidth.bytes_per_s / 1e9:.0f} GB/s",
    ]
    if "identical" in r:
        i = r["identical"]
        lines.append(
            f"sanity: greedy tokens identical, loraplex base vs transformers {i['base_vs_transformers'][0]}/"
            f"{i['base_vs_transformers'][1]}, loraplex+adapters vs PEFT {i['adapters_vs_peft'][0]}/"
            f"{i['adapters_vs_peft'][1]}" + (" (bfloat16: rounding may differ)" if "bfloat16" in r["dtype"] else ""))
    if r["workload"] == "8b-single":
        frac = r["systems"]["loraplex_base"]["roofline_fraction"]
        lines.append(f"headline: loraplex base decode at {100 * frac:.1f}% of the roofline ({_against(frac, ROOFLINE_TARGET)})")
    if r["workload"] == "8b-64":
        fracs = [r["systems"][k]["roofline_fraction"] for k in ("loraplex_adapters", "loraplex_base")]
        s = r["systems"]
        decode = s["loraplex_adapters"]["decode_tokens_per_s"] / s["loraplex_base"]["decode_tokens_per_s"]
        lines.append(f"headline: decode at {100 * fracs[0]:.1f}% of the roofline with adapters, {100 * fracs[1]:.1f}% "
                     f"without ({_against(min(fracs), ROOFLINE_TARGET)}); adapters / base decode = {decode:.2f}x "
                     f"({_against(decode, ADAPTERS_VS_BASE_TARGET, 'x')})")
    return "\n".join(lines)


def _against(value: float, target: float, unit: str = "%") -> str:
    shown = f"{100 * target:.0f}%" if unit == "%" else f"{target:.2f}x"
    return f"target {shown}: {'met' if value >= target else 'NOT met'}"


# ---- the online workload ----------------------------------------------------------------------------


def bench_online(args, loaded: LoadedModel) -> list[list[OnlineResult]]:
    """The online workload's timed runs, round by round (each round one run per system: over every adapter, on
    one adapter, on the base model)."""
    c, device = loaded.config, loaded.device
    slots = min(args.num_adapters, args.max_active_adapters)
    engine = Engine(loaded, EngineConfig(
        device=str(device), max_batch_total_tokens=args.kv_tokens, max_input_length=args.prompt_lens[1],
        max_total_tokens=args.prompt_lens[1] + args.output_lens[1], max_active_adapters=slots,
        max_lora_rank=SPEC.rank, prefix_caching=False,  # repeats rerun the same prompts: no run may reuse another's
        max_waiting_tokens=args.max_waiting_tokens,
    ))
    if args.gc == "server":  # as `loraplex serve` does once started; the adapters, made after, stay unfrozen
        freeze_start_up_heap()
    adapters = [random_adapter(f"online-{k}", engine.lora.base_shapes, SPEC, SPEC.rank, seed=args.seed * 7919 + k)
                for k in range(args.num_adapters)]
    for adapter in adapters:  # hashed now, as the server's store does at load, not on first use in the timed run
        adapter.fingerprint
    special = (c.bos_token_id, *c.eos_token_ids)
    workload = online_workload(c.vocab_size, args.rate, args.num_adapters, args.zipf_alpha, args.duration,
                               args.requests, tuple(args.prompt_lens), tuple(args.output_lens), special, args.seed)
    # Warm-up (untimed): one short request per adapter, so the timed runs start with them installed (as far
    # as the slots go) and with the engine's kernels warm.
    warm = online_workload(c.vocab_size, 1000.0, args.num_adapters, 0.0, None, args.num_adapters,
                           (args.prompt_lens[0], min(32, args.prompt_lens[1])), (2, 4), special, args.seed + 1)
    warm = dataclasses.replace(warm, adapter_ranks=list(range(args.num_adapters)))
    # The engine's own warm-up first, as `loraplex serve` does on CUDA: every decode graph captured (over an adapter
    # on PEFT's all-linear modules, the seven projections these adapters target, and without), so that none is
    # captured in a timed run.
    report = engine.warm_up()
    print(f"  online: engine warm-up: {report.requests} requests, {report.graphs_captured} graphs captured, "
          f"{report.seconds:.1f}s", file=sys.stderr, flush=True)
    run_online(engine, warm, adapters, "warm-up")
    if args.gc == "off":  # a diagnostic: an upper bound of what the collector costs the runs
        gc.disable()
    # The same arrivals three ways: over every adapter, all on one adapter (the 1,000-adapters-vs-one
    # ratio), and on the base model. With --repeats the systems take turns and each keeps its shortest run: the
    # device's host is shared, and one run per system swings by more than the ratios under test. Each round starts
    # with the next system, so that no system is always the first timed after the warm-up or a round's turn.
    systems = ((f"loraplex, {args.num_adapters} adapters / {slots} slots", adapters),
               ("loraplex, one adapter", [adapters[0]] * args.num_adapters),
               ("loraplex, base model", None))
    # And one untimed run per system on the timed workload itself: its longer prompts take paths the short warm-up
    # does not (chunked prompts' resumed attention, whose kernel is probed at first use; Triton specialisations of
    # other row counts), and the first system timed would pay them alone (0.70x in the first round, 0.87-0.94x in
    # the others, on the H200 at 6efa50c).
    for label, used in systems:
        run_online(engine, workload, used, f"{label} (warm-up)")
    rounds: list[list[OnlineResult]] = []
    for repeat in range(args.repeats):
        runs: list[OnlineResult | None] = [None] * len(systems)
        for k in [(repeat + i) % len(systems) for i in range(len(systems))]:
            label, used = systems[k]
            with _profiled(args.profile, f"online-{k}-{repeat}.pstats"):
                runs[k] = run_online(engine, workload, used, label)
            print(f"  online: {label}: {runs[k].makespan_s:.1f}s", file=sys.stderr, flush=True)
        rounds.append(runs)
    if args.trace:  # one more run per system, untimed: the profiler's start and stop stall it
        os.makedirs(args.trace, exist_ok=True)
        first, count = args.trace_steps
        for k, (label, used) in enumerate(systems):
            path = os.path.join(args.trace, f"online-{k}.json.gz")
            with StepTracer(engine, first, count, path) as tracer:
                run_online(engine, workload, used, label)
            print("\n" + describe_trace(tracer, label), flush=True)
    gc.enable()
    del engine
    return rounds


@contextlib.contextmanager
def _profiled(folder: str | None, name: str):
    """The block under cProfile, its stats written to folder/name (nothing without a folder)."""
    if folder is None:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        os.makedirs(folder, exist_ok=True)
        profiler.dump_stats(os.path.join(folder, name))


# ---- main -------------------------------------------------------------------------------------------


def _pair(text: str) -> list[int]:
    lo, hi = (int(x) for x in text.split(","))
    return [lo, hi]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few requests and tokens (a smoke test)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu (cpu with --smoke)")
    p.add_argument("--layers", type=int, default=32, help="layers of the 8B shape")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system (taking turns; the best is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--online-model", choices=["8b", "135m"], default="8b")
    p.add_argument("--rate", type=float, default=4.0, help="online: Poisson arrival rate, requests/s")
    p.add_argument("--duration", type=float, default=60.0, help="online: seconds of arrivals")
    p.add_argument("--requests", type=int, default=None, help="online: this many requests instead of --duration")
    p.add_argument("--zipf-alpha", type=float, default=1.0, help="online: adapter popularity power-law exponent")
    p.add_argument("--num-adapters", type=int, default=64, help="online: adapters the requests are drawn over")
    p.add_argument("--max-active-adapters", type=int, default=128, help="online: device adapter slots (at most)")
    p.add_argument("--prompt-lens", type=_pair, default=[8, 512], metavar="LO,HI", help="online: prompt lengths")
    p.add_argument("--output-lens", type=_pair, default=[8, 256], metavar="LO,HI", help="online: output lengths")
    p.add_argument("--max-waiting-tokens", type=int, default=EngineConfig.max_waiting_tokens,
                   help="online: the engine's (engine/scheduling/joins.py; 0: waiting requests join at every step)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="online: KV cache tokens (default: the engine sizes it from free memory)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--profile", metavar="DIR", help="online: each timed run under cProfile, its stats written to "
                   "DIR/online-<system>-<repeat>.pstats (systems 0, 1, 2: adapters, one adapter, base)")
    p.add_argument("--trace", metavar="DIR", help="online: after the timed runs, one more run per system with steps "
                   "--trace-steps traced (benchmarks/step_trace.py): DIR/online-<system>.json.gz and a summary")
    p.add_argument("--trace-steps", type=_pair, default=[40, 120], metavar="FIRST,COUNT",
                   help="online, with --trace: the steps traced, counted from the run's first")
    p.add_argument("--gc", choices=["server", "python", "off"], default=None,
                   help="online: Python's garbage collector as the server sets it (its start-up heap frozen, "
                   "server/heap.py; the default, but with --smoke), Python's defaults, or off for the runs (a "
                   "diagnostic)")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := set(args.workloads) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.gc = args.gc or ("python" if args.smoke else "server")  # a smoke run in a test process freezes nothing
    if args.smoke:
        args.device = args.device or "cpu"
        if args.requests is None:
            args.requests = 6
        args.rate, args.num_adapters = max(args.rate, 50.0), min(args.num_adapters, 4)
        args.prompt_lens, args.output_lens = [4, 16], [2, 6]
        args.kv_tokens = args.kv_tokens or 1024
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    log(f"loraplex against transformers and PEFT, workloads {','.join(args.workloads)}, on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
        + (" (smoke: a few minutes)" if args.smoke else " (the full set: tens of minutes)"))
    log("importing transformers and PEFT")
    import peft
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}, {str(dtype).removeprefix('torch.')}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, peft {peft.__version__}; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    log("measuring the copy bandwidth")
    bandwidth = roofline.copy_bandwidth(device, 64 * 2**20 if args.smoke else None)
    print(f"copy bandwidth: {bandwidth.describe()}", flush=True)
    figures = {"device": name, "dtype": str(dtype), "torch": torch.__version__, "smoke": args.smoke,
               "bandwidth": bandwidth.to_json(), "workloads": {}}
    fixed = SMOKE_FIXED if args.smoke else FIXED
    started = perf_counter()
    models: dict[str, LoadedModel] = {}

    def model(kind: str) -> LoadedModel:
        if kind not in models:
            models.clear()  # one model at a time on the device
            gc.collect()
            log(f"building the {kind} model")
            models[kind] = build_model(kind, device, dtype, args.layers, args.smoke)
        return models[kind]

    for kind in ("135m", "8b"):
        names = [w for w in args.workloads if w in fixed and fixed[w].model == kind]
        if not names:
            continue
        loaded = model(kind)
        with_peers = [n for n in names if fixed[n].peers]
        peers, peft_model = {}, None
        if with_peers:
            adapter_names = [f"adapter-{i}" for i in range(max(fixed[n].adapters for n in with_peers))]
            log(f"building the transformers and PEFT twins of the {kind} model")
            peft_model = make_peft_model(hf_twin(loaded), adapter_names, SPEC, seed=args.seed)
            peers = {"hf": hf_twin(loaded), "peft": peft_model}
        for w in names:
            log(f"workload {w}: each system timed")
            result = bench_fixed(w, fixed[w], loaded, peers, bandwidth, args.repeats, args.seed)
            figures["workloads"][w] = result
            print("\n" + format_fixed(result, bandwidth) + "\n", flush=True)
        del peers, peft_model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "online" in args.workloads:
        log(f"the online workload on {args.online_model}: each system served in turn")
        rounds = bench_online(args, model(args.online_model))
        best = [min(runs, key=lambda r: r.makespan_s) for runs in zip(*rounds)]  # each system's shortest run
        figures["workloads"]["online"] = [r.to_json() for r in best]
        figures["workloads"]["online_rounds"] = [[r.tokens_per_s for r in runs] for runs in rounds]
        setting = f"{models[args.online_model].model_id}, {name} {str(dtype).removeprefix('torch.')}" + (
            f"; best of {args.repeats} runs per system, taking turns" if args.repeats > 1 else "")
        print("\n" + format_online(best, setting, rounds) + "\n", flush=True)
    print(f"total benchmark time {perf_counter() - started:.0f}s (models, warm-ups included), load average "
          f"{os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
