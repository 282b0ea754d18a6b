"""The experts' grouped-GEMM kernel against the torch loop, at Mixtral-8x7B's shapes: `python -m benchmarks.moe`
(CUDA).

For each product of a sparse layer (gate_up 4096 -> 2 x 14336, down 14336 -> 4096; E = 8 experts, top_k = 2) and
P = 1, 8, 32, 64 token rows (`--rows`; P x top_k pairs, routed at random as the router would), the time per call of:

- `loop`: `grouped_product(..., fused=False)` as an eager step runs it: a fresh dispatch each call, so its
  `host_counts` read (a host sync) is paid, then one matmul per expert with pairs;
- `loop-gpu`: the same matmuls captured in a CUDA graph (counts already on the host): their GPU time alone, which no
  real step gets (the loop cannot be captured from a fresh dispatch);
- `kernel`: the Triton kernel (loraplex/layers/kernels/moe_gemm.py) called eagerly (launched directly);
- `kernel-gpu`: the kernel replayed in a CUDA graph, as decode steps run it.

Graphed times are replays of a graph of one call between CUDA events (graph_timing.graph_time_us); each call reads
its experts from HBM (an expert's weight, 235 MB for gate_up, is several times the L2). Eager times are CUDA events
around `--calls` calls after warm-up. The bandwidth is the bytes the call must read, each distinct expert the
routing touches once (its weight) plus the inputs and outputs, over the time, against the H200's 4.8 TB/s
(`--peak-tb-s`). Last, both products summed per P: a decode layer's expert time, and the speed-up over the loop.

`--shapes mixtral,qwen` adds Qwen1.5-MoE-A2.7B's (E = 60, top_k = 4, 2048 -> 2 x 1408, 1408 -> 2048); prefill sizes
are rows too (`--rows 1,8,32,64,512,2048`). `--sweep` tries configurations (DECODE_OPTIONS at P <= 64, PREFILL_OPTIONS
above) and prints the best per P over both products: set moe_gemm.CONFIGS from it.
`--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from benchmarks.graph_timing import graph_time_us
from benchmarks.progress import needs_cuda, progress
from loraplex.layers.moe import ExpertDispatch, grouped_product, route

# name -> (experts, top_k, hidden, intermediate)
MODELS = {"mixtral": (8, 2, 4096, 14336), "qwen": (60, 4, 2048, 1408)}
DTYPE = torch.bfloat16


class Layer:
    """One sparse layer's stacked expert weights (random), bf16."""

    def __init__(self, model: str, device: torch.device) -> None:
        self.model = model
        self.experts, self.top_k, hidden, inter = MODELS[model]
        g = torch.Generator(device=device).manual_seed(0)
        self.weights = {
            "gate_up": (torch.randn(self.experts, 2 * inter, hidden, generator=g, device=device) / hidden ** 0.5).to(DTYPE),
            "down": (torch.randn(self.experts, hidden, inter, generator=g, device=device) / inter ** 0.5).to(DTYPE),
        }

    def dispatch(self, rows: int, seed: int) -> ExpertDispatch:
        g = torch.Generator(device=self.weights["down"].device).manual_seed(seed)
        logits = torch.randn(rows, self.experts, generator=g, device=g.device)
        weights, chosen = route(logits, self.top_k, True)
        return ExpertDispatch.of(chosen, weights, self.experts)


def fresh(d: ExpertDispatch) -> ExpertDispatch:
    """The same routing with its host counts not yet read (each eager step reads them anew)."""
    return ExpertDispatch(d.rows, d.experts, d.weights, d.counts)


def eager_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def measure(layer: Layer, product: str, rows: int, calls: int, target_ms: float) -> dict:
    weight = layer.weights[product]
    d = layer.dispatch(rows, seed=rows)
    x = torch.randn(d.rows.numel(), weight.shape[2], device=weight.device, dtype=DTYPE)
    from loraplex.layers.kernels import moe_gemm  # imports Triton: CUDA machines only

    touched = sum(c > 0 for c in d.host_counts)
    per_expert = weight[0].numel() * weight.element_size()
    nbytes = touched * per_expert + x.numel() * x.element_size() + x.shape[0] * weight.shape[1] * weight.element_size()
    times = {
        "loop": eager_us(lambda: grouped_product(x, weight, fresh(d), fused=False), calls),
        "loop-gpu": graph_time_us([lambda: grouped_product(x, weight, d, fused=False)], target_ms),
        "kernel": eager_us(lambda: grouped_product(x, weight, d, fused=True), calls),
        "kernel-gpu": graph_time_us([lambda: grouped_product(x, weight, d, fused=True)], target_ms),
    }
    want = grouped_product(x.float(), weight.float(), d, fused=False)
    got = grouped_product(x, weight, d, fused=True).float()
    error = ((got - want).abs().max() / want.abs().max()).item()
    return {"us": times, "bytes": nbytes, "experts_touched": touched, "pairs": x.shape[0], "error": error,
            "config": moe_gemm.config(x.shape[0], weight.shape[0], weight.shape[1], weight.shape[2],
                                      x.element_size())}


COLUMNS = ["loop", "loop-gpu", "kernel", "kernel-gpu"]


def table(layer: Layer, results: dict, rows: list[int], peak: float) -> None:
    e, k, hidden, inter = MODELS[layer.model]
    print(f"{layer.model}: E={e}, top_k={k}, hidden {hidden}, intermediate {inter}; us per call")
    head = ["product", "P", "pairs", "experts read", "MB read"] + [f"{c} us" for c in COLUMNS]
    head += ["kernel-gpu TB/s (% of peak)", "x loop", "x loop-gpu", "rel err", "config (BM, BN, BK, G, warps, stages)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for product in ("gate_up", "down"):
        for m in rows:
            r = results[product][m]
            us = r["us"]
            tb_s = r["bytes"] / us["kernel-gpu"] / 1e6
            cells = [product, str(m), str(r["pairs"]), str(r["experts_touched"]), f"{r['bytes'] / 1e6:.0f}"]
            cells += [f"{us[c]:.1f}" for c in COLUMNS]
            cells += [f"{tb_s:.2f} ({100 * tb_s / peak:.0f}%)", f"{us['loop'] / us['kernel-gpu']:.2f}",
                      f"{us['loop-gpu'] / us['kernel-gpu']:.2f}", f"{r['error']:.1e}", str(r["config"])]
            print("| " + " | ".join(cells) + " |")
    print()
    print(f"{layer.model}: a layer's two products, us (kernel-gpu TB/s):")
    print("| P | " + " | ".join(COLUMNS) + " | kernel-gpu TB/s | kernel-gpu x loop |")
    print("|" + "---|" * (len(COLUMNS) + 3))
    for m in rows:
        total = {c: sum(results[p][m]["us"][c] for p in ("gate_up", "down")) for c in COLUMNS}
        nbytes = sum(results[p][m]["bytes"] for p in ("gate_up", "down"))
        print(f"| {m} | " + " | ".join(f"{total[c]:.1f}" for c in COLUMNS)
              + f" | {nbytes / total['kernel-gpu'] / 1e6:.2f} | {total['loop'] / total['kernel-gpu']:.2f} |")
    print()


# The configurations --sweep tries: (BLOCK_M, GROUP_M, BLOCK_N, BLOCK_K bytes, num_warps, num_stages)
DECODE_OPTIONS = list(itertools.product((16, 32), (1, 8), (64, 128), (256, 512), (4,), (3, 4)))
PREFILL_OPTIONS = list(itertools.product((64, 128), (8,), (128, 256), (128,), (4, 8), (3, 4)))


def sweep(layer: Layer, rows: list[int], target_ms: float) -> dict:
    """Configurations (DECODE_OPTIONS for P <= 64, else PREFILL_OPTIONS) by both products' graphed time per P; the
    three best printed, with their largest error against the torch loop (relative to its largest value)."""
    from loraplex.layers.kernels import moe_gemm

    saved = moe_gemm.config
    best = {}
    print(f"{layer.model}: configuration sweep (both products, kernel-gpu us; * = best)")
    print("| P | BLOCK_M | GROUP_M | BLOCK_N | BLOCK_K bytes | warps | stages | us | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for m in rows:
            cases = []
            for product in ("gate_up", "down"):
                weight = layer.weights[product]
                d = layer.dispatch(m, seed=m)
                x = torch.randn(d.rows.numel(), weight.shape[2], device=weight.device, dtype=DTYPE)
                cases.append((x, weight, d, grouped_product(x, weight, d, fused=False).float()))
            options = []
            for option in DECODE_OPTIONS if m <= 64 else PREFILL_OPTIONS:
                block_m, group_m, block_n, k_bytes, warps, stages = option
                moe_gemm.config = lambda *a, o=(block_m, block_n, k_bytes // 2, group_m, warps, stages): o
                try:
                    us = sum(graph_time_us([lambda c=c: grouped_product(*c[:3], fused=True)], target_ms)
                             for c in cases)
                except Exception as exc:  # noqa: BLE001 - too much shared memory, say: that option is out
                    print("| " + " | ".join(map(str, (m, *option))) + f" | failed: {type(exc).__name__} | |")
                    continue
                error = max(((grouped_product(*c[:3], fused=True).float() - c[3]).abs().max() / c[3].abs().max()).item()
                            for c in cases)
                options.append((us, option, error))
            options.sort()
            for us, option, error in options[:3]:
                mark = " *" if option == options[0][1] else ""
                print("| " + " | ".join(map(str, (m, *option))) + f" | {us:.1f}{mark} | {error:.1e} |")
            names = ("block_m", "group_m", "block_n", "block_k_bytes", "warps", "stages")
            best[m] = {"us": options[0][0], **dict(zip(names, options[0][1]))}
    finally:
        moe_gemm.config = saved
    print()
    print("best per P:", json.dumps(best))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,32,64", help="token rows P, comma-separated (pairs: P x top_k)")
    parser.add_argument("--shapes", default="mixtral", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--calls", type=int, default=50, help="eager calls timed per figure")
    parser.add_argument("--target-ms", type=float, default=20.0, help="graph replay time per figure")
    parser.add_argument("--peak-tb-s", type=float, default=4.8, help="the HBM bandwidth to compare with (H200)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the decode configurations")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.moe")) is not None:
        return code
    log(f"MoE grouped products on {torch.cuda.get_device_name()}: shapes {args.shapes}, P {args.rows}"
        + (", with the configuration sweep (tens of minutes)" if args.sweep else " (minutes)"))
    from loraplex.layers.kernels import moe_gemm

    rows = [int(r) for r in args.rows.split(",")]
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; bf16; CONFIGS={moe_gemm.CONFIGS}")
    report = {"device": torch.cuda.get_device_name(), "results": {}, "sweep": {}}
    for model in args.shapes.split(","):
        started = time.time()
        log(f"{model}: building the layer, then timing every method at P {args.rows}")
        layer = Layer(model, device)
        results = {p: {m: measure(layer, p, m, args.calls, args.target_ms) for m in rows} for p in ("gate_up", "down")}
        table(layer, results, rows, args.peak_tb_s)
        report["results"][model] = results
        if args.sweep:
            log(f"{model}: the configuration sweep")
            report["sweep"][model] = sweep(layer, rows, args.target_ms / 2)
        print(f"({model}: {time.time() - started:.0f} s)\n")
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
