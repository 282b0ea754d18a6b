"""LoRA kernels for a decode step, timed against each other in one process: `python -m benchmarks.lora_kernels`.

Three ways to add every row's own adapter delta to one linear's output, on the same rows and weights:
- segments: `add_lora`, one shrink/expand matmul pair per adapter;
- stacked: `add_lora_stacked`, each adapter's rows gathered into its own padded group, two batched matmuls;
- masked (reference only, unsafe): every row times every adapter's A, a 0/1 mask, one expand. This was the
  stacked form before the isolation rule (docs/architecture.md): inf x 0 = NaN crosses rows there.
Prints microseconds per call and the ratios against `stacked`, for decode-shaped batches.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.progress import progress
from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.adapter import LoraWeights
from loraplex.lora.step.kernels import add_lora, add_lora_stacked
from loraplex.lora.device.table import Stack

# (name, in_features, out_features): Llama-3.1-8B's projections and SmolLM2-135M's.
SHAPES = {
    "8b": [("qo", 4096, 4096), ("kv", 4096, 1024), ("up", 4096, 14336), ("down", 14336, 4096)],
    "135m": [("qo", 576, 576), ("kv", 576, 192), ("up", 576, 1536), ("down", 1536, 576)],
}


def masked(out, x, mask, a_flat, b_flat):
    return out.addmm_((x @ a_flat.t()).mul_(mask), b_flat.t())


def timed(fn, repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e6


def bench_case(device, dtype, adapters: int, rows_per_adapter: int, rank: int, fan_in: int, fan_out: int, repeats: int):
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = adapters * rows_per_adapter

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(device, dtype)

    x, base = rand(rows, fan_in), rand(rows, fan_out)
    weights = [LoraWeights(rand(rank, fan_in), rand(fan_out, rank), 2.0) for _ in range(adapters)]
    segments = [LoraSegment(s, s * rows_per_adapter, (s + 1) * rows_per_adapter) for s in range(adapters)]
    a_stack = torch.stack([w.a for w in weights])
    b_stack = torch.stack([w.b * w.scale for w in weights])
    groups = Stack({s: s for s in range(adapters)}, {}, adapters, rank).groups(segments, device)
    a_flat = a_stack.reshape(adapters * rank, fan_in)
    b_flat = b_stack.permute(1, 0, 2).reshape(fan_out, adapters * rank).contiguous()
    mask = torch.zeros(rows, adapters * rank, device=device, dtype=dtype)
    for s in segments:
        mask[s.start : s.end, s.slot * rank : (s.slot + 1) * rank] = 1

    results = {
        "segments": lambda: add_lora(base.clone(), x, segments, weights),
        "stacked": lambda: add_lora_stacked(base.clone(), x, groups, a_stack, b_stack),
        "masked": lambda: masked(base.clone(), x, mask, a_flat, b_flat),
    }
    want = results["segments"]().float()
    for name, fn in results.items():
        assert torch.allclose(fn().float(), want, rtol=5e-2, atol=5e-2), name
    return {name: timed(fn, repeats, device) for name, fn in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=SHAPES, default=None, help="default: 8b on CUDA, 135m on CPU")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    log = progress()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = args.model or ("8b" if device.type == "cuda" else "135m")
    repeats = args.repeats or (200 if device.type == "cuda" else 50)
    log(f"LoRA kernels (segments, stacked, masked) on {device}, {model} shapes, rank {args.rank}: 5 batch cases x "
        f"{len(SHAPES[model])} modules, {repeats} calls each (under a minute on CUDA, a few on CPU)")
    print(f"device {device} ({dtype}), {model} shapes, rank {args.rank}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'adapters x rows':>16} {'module':>6} {'segments':>10} {'stacked':>10} {'masked':>10}  segments/stacked  masked/stacked")
    totals = {"segments": 0.0, "stacked": 0.0, "masked": 0.0}
    for adapters, per in [(8, 1), (8, 4), (16, 2), (32, 2), (8, 16)]:
        log(f"{adapters} adapters x {per} rows")
        for module, fan_in, fan_out in SHAPES[model]:
            t = bench_case(device, dtype, adapters, per, args.rank, fan_in, fan_out, repeats)
            for k in totals:
                totals[k] += t[k]
            print(f"{adapters:>9} x {per:<4} {module:>6} {t['segments']:>9.0f}u {t['stacked']:>9.0f}u {t['masked']:>9.0f}u"
                  f"  {t['segments'] / t['stacked']:>15.2f}  {t['masked'] / t['stacked']:>14.2f}")
    print(f"all cases: segments/stacked {totals['segments'] / totals['stacked']:.2f}, "
          f"masked/stacked {totals['masked'] / totals['stacked']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
