"""W4A16 kernels against bf16 on Llama-3.1-8B's linears: `python -m benchmarks.w4a16_kernels` (CUDA).

For each linear (4096->4096, 4096->1024, 4096->14336, 14336->4096) and M rows (default 1, 8, 32, 64), groups of 128
with zero points: bf16 `F.linear`, our Triton dequantize-GEMM (loraplex.quantization.w4a16.kernels) and PyTorch's
tinygemm (`_weight_int4pack_mm`). Each call is timed inside a CUDA graph (as decode runs), over enough copies of the
weights that they never sit in L2 (so every call reads its weight from HBM), replayed until tens of milliseconds
have passed. Printed: microseconds per call, the weight bytes read per second (scales and zeros included) and its
share of the H200's 4.8 TB/s, the speed-up over bf16, and each candidate's largest error against x @ the
dequantized weight (relative to the output's largest value; bf16 rounding is ~4e-3). Then a decode layer's linears
(q and o, k and v, gate and up, down: each shape's count) in total per M, the figure the issue's targets read
(>= 2.5x bf16 at M = 1, no worse than bf16 at M = 64).

Then (unless --no-sweep) a sweep of the Triton kernel's launch shapes (PROGRAMS_PER_SM x BLOCK_N of M's bucket x
PARTIAL_SHARE x SPLIT_REDUCE), printing the best per M over a layer's total: set w4a16_triton's constants from it, and
w4a16.KERNEL to the faster candidate.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Callable

import torch
from torch.nn import functional as F

from benchmarks.graph_timing import graph_time_us, weight_copies
from benchmarks.progress import needs_cuda, progress

try:  # Triton's kernels: a machine without triton (no CUDA) gets main's one line and status 2, not a traceback
    from loraplex.quantization.w4a16 import kernels as w4a16_triton, tinygemm as w4a16_tinygemm
    from loraplex.quantization.split_k import split_counters
    from loraplex.quantization.w4a16.mode import pack_int4, quantize_groups
except ModuleNotFoundError as missing:
    if missing.name != "triton":
        raise

# (name, in_features, out_features, how many a Llama-3.1-8B layer has)
SHAPES = [("qo", 4096, 4096, 2), ("kv", 4096, 1024, 2), ("gate_up", 4096, 14336, 2), ("down", 14336, 4096, 1)]
HBM_BYTES_PER_S = 4.8e12
DTYPE = torch.bfloat16


class Case:
    """One linear's weights in every form, with enough copies to defeat L2."""

    def __init__(self, k: int, n: int, group: int, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(k * 7 + n)
        weight = torch.randn(n, k, generator=gen, device=device) / k**0.5
        q, zeros, scales = quantize_groups(weight, group, symmetric=False)
        self.k, self.n, self.group = k, n, group
        self.scales, self.zeros = scales.to(DTYPE), zeros.to(DTYPE)
        self.dequantized = ((q.float() - self.zeros.float().repeat_interleave(group, 0))
                            * self.scales.float().repeat_interleave(group, 0)).t().to(DTYPE).contiguous()
        self.bf16 = weight_copies([self.dequantized])
        self.triton = weight_copies([pack_int4(q, w4a16_triton.PACK_BLOCK), self.scales, self.zeros])
        self.counters = split_counters(device)  # shared by the copies: their calls run in turn
        try:
            self.tinygemm = weight_copies(list(w4a16_tinygemm.pack(q, self.zeros, self.scales)))
            self.tinygemm_error = None
        except Exception as exc:  # noqa: BLE001 - reported in the table
            self.tinygemm, self.tinygemm_error = None, " ".join(str(exc).split())[:120]

    @staticmethod
    def bytes_of(copies: list[list[torch.Tensor]]) -> int:
        return sum(t.numel() * t.element_size() for t in copies[0])

    def candidates(self) -> dict[str, tuple[list[list[torch.Tensor]], Callable]]:
        group = self.group
        out = {
            "bf16": (self.bf16, lambda x, w: F.linear(x, w)),
            "triton": (self.triton, lambda x, qw, s, z: w4a16_triton.matmul(x, qw, s, z, group, None, self.counters)),
        }
        if self.tinygemm is not None:
            out["tinygemm"] = (self.tinygemm, lambda x, p, sz: w4a16_tinygemm.matmul(x, p, sz, group, None))
        return out


def measure(case: Case, m: int, name: str, target_ms: float = 30.0) -> dict:
    copies, fn = case.candidates()[name]
    x = torch.randn(m, case.k, device="cuda", dtype=DTYPE)
    us = graph_time_us([lambda c=c: fn(x, *c) for c in copies], target_ms)
    want = x.float() @ case.dequantized.float().t()
    error = ((fn(x, *copies[0]).float() - want).abs().max() / want.abs().max()).item()
    weight_bytes = Case.bytes_of(copies)
    return {"us": us, "bytes": weight_bytes, "tb_s": weight_bytes / us / 1e6, "error": error}


def table(results: dict, rows: list[int], names: list[str]) -> None:
    head = ["shape", "M"] + [f"{n} us" for n in names] + [f"{n} TB/s (% of 4.8)" for n in names]
    head += [f"{n} x bf16" for n in names if n != "bf16"] + [f"{n} err" for n in names if n != "bf16"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for shape, k, n, _ in SHAPES:
        for m in rows:
            r = results[shape][m]
            cells = [f"{shape} {k}->{n}", str(m)]
            cells += [f"{r[c]['us']:.2f}" if c in r else "n/a" for c in names]
            cells += [f"{r[c]['tb_s']:.2f} ({100 * r[c]['tb_s'] * 1e12 / HBM_BYTES_PER_S:.0f}%)" if c in r else "n/a"
                      for c in names]
            cells += [f"{r['bf16']['us'] / r[c]['us']:.2f}" if c in r else "n/a" for c in names if c != "bf16"]
            cells += [f"{r[c]['error']:.1e}" if c in r else "n/a" for c in names if c != "bf16"]
            print("| " + " | ".join(cells) + " |")
    print()
    print("Decode layer's linears (2 qo + 2 kv + 2 gate_up + 1 down), us per layer and x bf16:")
    print("| M | " + " | ".join(names) + " | " + " | ".join(f"{n} x bf16" for n in names if n != "bf16") + " |")
    print("|" + "---|" * (1 + 2 * len(names) - 1))
    for m in rows:
        totals = {c: sum(count * results[s][m][c]["us"] for s, _, _, count in SHAPES) for c in names
                  if all(c in results[s][m] for s, _, _, _ in SHAPES)}
        cells = [str(m)] + [f"{totals[c]:.1f}" if c in totals else "n/a" for c in names]
        cells += [f"{totals['bf16'] / totals[c]:.2f}" if c in totals else "n/a" for c in names if c != "bf16"]
        print("| " + " | ".join(cells) + " |")
    print()


def sweep(cases: dict[str, Case], rows: list[int]) -> dict:
    """The Triton kernel's launch shapes: PROGRAMS_PER_SM x BLOCK_N of M's tile bucket, per M; the best by the
    layer's total time."""
    saved = (w4a16_triton.PROGRAMS_PER_SM, list(w4a16_triton.TILES), w4a16_triton.PARTIAL_SHARE,
             w4a16_triton.SPLIT_REDUCE)
    best = {}
    print("Triton launch-shape sweep (layer total us, the three fastest per M; * = best):")
    print("| M | PROGRAMS_PER_SM | BLOCK_N | PARTIAL_SHARE | SPLIT_REDUCE | layer us | max err |")
    print("|---|---|---|---|---|---|---|")
    try:
        for m in rows:
            options = []
            for option in itertools.product((4, 8, 16), (32, 64, 128), (0.25, 1.0), ("in-kernel", "kernel")):
                programs, block_n, share, reduce = option
                w4a16_triton.PROGRAMS_PER_SM, w4a16_triton.PARTIAL_SHARE = programs, share
                w4a16_triton.SPLIT_REDUCE = reduce
                w4a16_triton.TILES = [(most, bm, block_n if (most is None or m <= most) else bn, warps)
                                      for most, bm, bn, warps in saved[1]]
                runs = [(count, measure(cases[s], m, "triton", target_ms=10.0)) for s, _, _, count in SHAPES]
                total = sum(count * r["us"] for count, r in runs)
                options.append((total, option, max(r["error"] for _, r in runs)))
            options.sort()
            for total, option, error in options[:3]:  # the three fastest
                mark = " *" if option == options[0][1] else ""
                print("| " + " | ".join(map(str, (m, *option))) + f" | {total:.1f}{mark} | {error:.1e} |")
            total, (programs, block_n, share, reduce), error = options[0]
            best[m] = {"layer_us": total, "programs_per_sm": programs, "block_n": block_n, "partial_share": share,
                       "split_reduce": reduce, "error": error}
    finally:
        (w4a16_triton.PROGRAMS_PER_SM, w4a16_triton.TILES, w4a16_triton.PARTIAL_SHARE,
         w4a16_triton.SPLIT_REDUCE) = saved
    print()
    print("best per M:", json.dumps(best))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,32,64", help="M values, comma-separated")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--no-sweep", action="store_true", help="skip the Triton launch-shape sweep")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.w4a16_kernels")) is not None:
        return code
    log(f"W4A16 kernels against bf16 on {torch.cuda.get_device_name()}: M {args.rows}"
        + ("" if args.no_sweep else ", then the Triton launch-shape sweep") + " (minutes)")
    rows = [int(r) for r in args.rows.split(",")]
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; groups of {args.group}, zero points; "
          f"Triton PROGRAMS_PER_SM={w4a16_triton.PROGRAMS_PER_SM} TILES={w4a16_triton.TILES} "
          f"PARTIAL_SHARE={w4a16_triton.PARTIAL_SHARE} SPLIT_REDUCE={w4a16_triton.SPLIT_REDUCE}")
    log("quantizing the 8B linears")
    cases = {shape: Case(k, n, args.group, device) for shape, k, n, _ in SHAPES}
    for shape, case in cases.items():
        if case.tinygemm_error:
            print(f"tinygemm unavailable for {shape}: {case.tinygemm_error}")
    names = ["bf16", "triton"] + (["tinygemm"] if all(c.tinygemm is not None for c in cases.values()) else [])
    results = {}
    for shape, _, _, _ in SHAPES:
        log(f"{shape}: {', '.join(names)} at M {args.rows}")
        results[shape] = {m: {name: measure(cases[shape], m, name) for name in names} for m in rows}
    table(results, rows, names)
    if not args.no_sweep:
        log("the Triton launch-shape sweep")
    best = {} if args.no_sweep else sweep(cases, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "group": args.group, "results": results,
                       "sweep": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
