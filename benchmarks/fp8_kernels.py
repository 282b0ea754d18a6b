"""FP8 linears against bfloat16 on the Llama-3.1-8B linears (issue 36): `python -m benchmarks.fp8_kernels` on an
FP8 GPU (Ada, Hopper).

For each linear (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096) and M = 1, 8, 32, 64
rows, the time per call of:

- `bf16`: F.linear on the bfloat16 weight;
- `fp8`: Fp8Linear as the engine runs it (activations quantized by the Triton kernel, then `torch._scaled_mm`);
- `fp8-torch`: the same with the activations quantized by the torch ops (four launches: the fallback);
- `fp8-p17`: `fp8` with fewer than 17 rows padded to 17 zero rows (Fp8Linear.min_rows), should cuBLASLt's FP8
  kernels for a few rows be slower than for 17;
- `gemm`: `torch._scaled_mm` alone on already-quantized activations (what the quantization costs is fp8 - gemm);
- `block`: Fp8BlockLinear (128 x 128 block scales; dequantizes its weight on every call: exact, slow);
- `blk-mm`: what a tensor-core path for block checkpoints would take: activations quantized per 1 x 128 group
  (torch ops) and `torch._scaled_mm` with (1x128, 128x128) block scales, where this torch and GPU run it (else the
  note says why); its largest error against the exact block product is printed too (it rounds the activations,
  the exact layer does not);
- `torchao`: torchao's float8 dynamic-activation / per-row weight inference path, when torchao imports (else
  the column says why not).

Each is timed as the engine's decode steps run: a CUDA graph of `--calls` calls, replayed `--replays` times between
CUDA events (the best replay counts), cycling over enough copies of the weights that none is in L2 when read.
Reported per call in microseconds, with the FP8 path's bytes (weight, scales, activations, output) per second
against the H200's 4.8 TB/s (`--peak-tb-s`) and against the measured copy bandwidth; last, the four linears of a
layer summed (the decode step's linear time at M rows) for bf16, fp8, fp8-torch and fp8-p17, and their ratios.
Choose the activation quantizer by fp8 vs fp8-torch, the padding (fp8/layers.py SCALED_MM_MIN_ROWS) by fp8 vs
fp8-p17, and the FP8 product (ours or torchao's) by fp8 vs torchao.
`--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from benchmarks import roofline
from benchmarks.progress import needs_cuda, progress
from loraplex.quantization.fp8 import numerics
from loraplex.quantization.fp8.mode import quantize_linear
from loraplex.quantization.fp8.layers import Fp8BlockLinear

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 8, 32, 64)
L2_FLUSH_BYTES = 256 * 2**20  # more than the H200's 50 MB L2, so every call reads its weight from HBM
DTYPE = torch.bfloat16


def graph_seconds(calls: list, replays: int) -> float:
    """Seconds per call of `calls` (closures), captured once into one CUDA graph and replayed."""
    for call in calls[:2]:
        call()  # compiles Triton kernels and warms cuBLAS before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    best = math.inf
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del graph
    return best / len(calls)


def torchao_layers(weights: list[torch.Tensor]):
    """torchao's float8 (dynamic per-row activations, per-row weights) linears, or the reason there are none."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except Exception as exc:  # noqa: BLE001 - absent, or an install that fails to import
        return None, f"torchao unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:60] if str(exc) else ''})"
    layers = []
    try:
        for weight in weights:
            layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=DTYPE)
            layer.weight.data.copy_(weight)
            model = torch.nn.Sequential(layer)
            quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            layers.append(model)
    except Exception as exc:  # noqa: BLE001 - a torchao that cannot run here says why
        return None, f"torchao failed ({type(exc).__name__}: {str(exc).splitlines()[0][:60] if str(exc) else ''})"
    return layers, ""


def block_layer(weight: torch.Tensor) -> Fp8BlockLinear:
    n, k = weight.shape
    blocks = weight.float().view(n // 128, 128, k // 128, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / numerics.FP8_MAX).clamp_min(numerics.MIN_SCALE)
    q = numerics.to_fp8(blocks / scale[:, None, :, None]).view(n, k)
    return Fp8BlockLinear(q, scale, (128, 128))


def block_scaled_mm(layer: Fp8BlockLinear, x: torch.Tensor):
    """A closure computing `layer`'s product on the tensor cores with block scales (activations per 1 x 128
    group), and its largest relative error against the exact product; or (None, why not)."""
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale_a = (groups.abs().amax(-1) / numerics.FP8_MAX).clamp_min(numerics.MIN_SCALE)
    q = numerics.to_fp8(groups / scale_a[..., None]).view(m, k)
    errors = []
    for name, a, b in (("M-major scale_a", scale_a.t().contiguous().t(), layer.weight_scale_inv.t()),
                       ("row-major scales", scale_a.contiguous(), layer.weight_scale_inv.t().contiguous())):
        call = lambda a=a, b=b: torch._scaled_mm(q, layer.weight.t(), scale_a=a, scale_b=b, out_dtype=DTYPE)  # noqa: E731
        try:
            got = call().float()
        except Exception as exc:  # noqa: BLE001 - not supported by this torch / cuBLAS / GPU
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}")
            continue
        want = layer(x).float()
        return call, f"{name}; max error {((got - want).abs().max() / want.abs().max()).item():.2%} of max |out|"
    return None, "; ".join(errors)


def bench_shape(name: str, k: int, n: int, rows: tuple[int, ...], calls: int, replays: int, with_torchao: bool):
    copies = max(1, math.ceil(L2_FLUSH_BYTES / (n * k)))  # fp8 bytes; the bf16 copies are twice as large
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) * k ** -0.5 for _ in range(copies)]
    fp8 = []
    for weight in weights:
        linear = torch.nn.Linear(k, n, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        fp8.append(quantize_linear(linear, "cuda", DTYPE))
    blocks = [block_layer(w) for w in weights[:2]]
    ao, ao_note = torchao_layers(weights) if with_torchao else (None, "skipped (--no-torchao)")
    results = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        pick = lambda layers: [layers[i % len(layers)] for i in range(calls)]  # noqa: E731
        row = {"shape": name, "k": k, "n": n, "rows": m}
        row["bf16"] = graph_seconds([lambda w=w: F.linear(x, w) for w in pick(weights)], replays)
        for layer in fp8:
            layer.activation_quant = "triton"
        row["fp8"] = graph_seconds([lambda l=l: l(x) for l in pick(fp8)], replays)
        for layer in fp8:
            layer.min_rows = 17
        row["fp8_p17"] = graph_seconds([lambda l=l: l(x) for l in pick(fp8)], replays) if m < 17 else row["fp8"]
        for layer in fp8:
            layer.activation_quant, layer.min_rows = "torch", 1
        row["fp8_torch"] = graph_seconds([lambda l=l: l(x) for l in pick(fp8)], replays)
        q, q_scale = numerics.quantize_rows_torch(x, None)
        row["gemm"] = graph_seconds([lambda l=l: numerics.scaled_mm(q, q_scale, l.weight, l.weight_scale.view(1, -1),
                                                                    DTYPE) for l in pick(fp8)], replays)
        row["block"] = graph_seconds([lambda l=l: l(x) for l in pick(blocks)], max(3, replays // 4))
        block_mms = [block_scaled_mm(b, x) for b in blocks]
        row["blk_mm_note"] = block_mms[0][1]
        row["blk_mm"] = None if block_mms[0][0] is None else graph_seconds(
            [call for call, _ in pick(block_mms)], replays)
        row["torchao"] = graph_seconds([lambda l=l: l(x) for l in pick(ao)], replays) if ao else None
        row["torchao_note"] = ao_note
        row["fp8_bytes"] = n * k + 4 * n + m * k * (2 + 1) + 4 * m + 2 * m * n
        row["bf16_bytes"] = 2 * n * k + 2 * m * k + 2 * m * n
        results.append(row)
        del x
    del weights, fp8, blocks, ao
    torch.cuda.empty_cache()
    return results


def us(seconds: float | None) -> str:
    return "      -" if seconds is None else f"{seconds * 1e6:7.1f}"


def report(results: list[dict], peak: float, copy_bytes_per_s: float) -> list[str]:
    lines = [f"{'linear':>8} {'M':>3} | {'bf16':>7} {'fp8':>7} {'fp8-tor':>7} {'fp8-p17':>7} {'gemm':>7} {'block':>7} {'blk-mm':>7} {'torchao':>7}"
             f" | {'bf16/fp8':>8} | {'fp8 TB/s':>8} {'of peak':>7} {'of copy':>7} | {'bf16 TB/s':>9}  (us per call)"]
    for r in results:
        rate = r["fp8_bytes"] / r["fp8"]
        lines.append(
            f"{r['shape']:>8} {r['rows']:>3} | {us(r['bf16'])} {us(r['fp8'])} {us(r['fp8_torch'])} {us(r['fp8_p17'])} {us(r['gemm'])} "
            f"{us(r['block'])} {us(r['blk_mm'])} {us(r['torchao'])} | {r['bf16'] / r['fp8']:8.2f} | {rate / 1e12:8.2f} "
            f"{rate / peak:7.0%} {rate / copy_bytes_per_s:7.0%} | {r['bf16_bytes'] / r['bf16'] / 1e12:9.2f}")
    notes = {r["torchao_note"] for r in results if r["torchao_note"]}
    lines += [f"torchao: {note}" for note in notes]
    lines += [f"blk-mm {r['shape']} M={r['rows']}: {r['blk_mm_note']}" for r in results]
    lines.append("one layer's four linears (decode step linear time per layer):")
    for m in sorted({r["rows"] for r in results}):
        layer = [r for r in results if r["rows"] == m]
        if len(layer) != len(SHAPES):
            continue
        total = {key: sum(r[key] for r in layer) for key in ("bf16", "fp8", "fp8_torch", "fp8_p17", "gemm")}
        fp8_bytes = sum(r["fp8_bytes"] for r in layer)
        lines.append(f"  M={m:>2}: bf16 {us(total['bf16'])} fp8 {us(total['fp8'])} fp8-torch {us(total['fp8_torch'])}"
                     f" fp8-p17 {us(total['fp8_p17'])} gemm {us(total['gemm'])} | bf16/fp8 {total['bf16'] / total['fp8']:.2f}x,"
                     f" bf16/fp8-torch {total['bf16'] / total['fp8_torch']:.2f}x, bf16/fp8-p17 "
                     f"{total['bf16'] / total['fp8_p17']:.2f}x | fp8 at {fp8_bytes / total['fp8'] / peak:.0%} of peak")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--calls", type=int, default=24, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--peak-tb-s", type=float, default=4.8)
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.fp8_kernels")) is not None:
        return code
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"benchmarks.fp8_kernels needs an FP8 GPU (compute capability 8.9+), not {torch.cuda.get_device_name()}",
              file=sys.stderr)
        return 2
    log(f"FP8 kernels against bf16 on {torch.cuda.get_device_name()}: shapes {args.shapes}, rows {args.rows} "
        "(a few minutes)")
    log("measuring the copy bandwidth")
    bandwidth = roofline.copy_bandwidth(torch.device("cuda"))
    rows = tuple(int(r) for r in args.rows.split(","))
    results = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        log(f"shape {name} ({k} -> {n}): every kernel at rows {args.rows}")
        results += bench_shape(name, k, n, rows, args.calls, args.replays, not args.no_torchao)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"{bandwidth.bytes_per_s / 1e12:.2f} TB/s, peak {args.peak_tb_s} TB/s")
    print("\n".join(report(results, args.peak_tb_s * 1e12, bandwidth.bytes_per_s)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_bytes_per_s": bandwidth.bytes_per_s, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
