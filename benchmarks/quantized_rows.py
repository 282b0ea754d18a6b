"""The few-row (decode) quantized products against bf16, and a sweep of their launch shapes:
`python -m benchmarks.quantized_rows` on a CUDA GPU (FP8 needs compute capability 8.9+).

The linears of one Llama-3.1-8B decode layer as the engine runs them (q/k/v and gate/up fused: 4096->6144,
4096->4096, 4096->28672, 14336->4096), for M rows (default 1, 2, 4, 8, 16): bf16 `F.linear`, then every launch
shape of a grid for `weight_only` on FP8 weights (kernel "rows" or "dot", BLOCK_N, warps, stages, programs per SM,
in-kernel split reduction) and on bitsandbytes' int8 weights (`--int8-rows`: kernel, BLOCK_M, BLOCK_N, warps, stages,
programs per SM, in-kernel reduction), bitsandbytes' own nf4 kernels as FourBitLinear calls them (`--nf4-rows`: its
gemv for one row, its dequantization and a bf16 product for more), and for `w4a16_rows` (groups of 128 with zero
points; BLOCK_N, warps, stages, programs per SM, in-kernel reduction), each timed in CUDA graphs over weight copies
that defeat L2 (benchmarks/graph_timing). Printed per M: the layer's bf16 time, the three fastest shapes of each kernel
with their speed-up over bf16 and largest error against x @ the dequantized weight (relative to the output's largest
value), and the best as JSON: set `weight_only.CONFIGS` and `w4a16_rows.CONFIGS` from it.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from torch.nn import functional as F

from benchmarks.graph_timing import graph_time_us, weight_copies
from benchmarks.progress import needs_cuda, progress

try:  # Triton's kernels: a machine without triton (no CUDA) gets main's one line and status 2, not a traceback
    from loraplex.quantization import weight_only
    from loraplex.quantization.w4a16 import kernels as w4a16_triton, rows as w4a16_rows
    from loraplex.quantization.fp8.mode import quantize_linear
    from loraplex.quantization.split_k import split_counters
    from loraplex.quantization.w4a16.mode import pack_int4, quantize_groups
except ModuleNotFoundError as missing:
    if missing.name != "triton":
        raise

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
DTYPE = torch.bfloat16
GROUP = 128


class Linear:
    """One linear's weight as bf16, FP8 (per-channel), W4A16 and bitsandbytes int8 and nf4 (when it is installed),
    with copies of each that defeat L2."""

    def __init__(self, k: int, n: int, fp8: bool) -> None:
        gen = torch.Generator(device="cuda").manual_seed(k + 7 * n)
        weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(DTYPE)
        self.k, self.n = k, n
        self.bf16 = weight_copies([weight])
        self.fp8 = None
        if fp8:
            fp8_layer = quantize_linear(_linear_of(weight), "cuda", DTYPE)
            self.fp8 = weight_copies([fp8_layer.weight.data, fp8_layer.weight_scale.data])
            self.fp8_reference = (fp8_layer.weight.float() * fp8_layer.weight_scale[:, None]).t()
        q, zeros, scales = quantize_groups(weight.float(), GROUP, symmetric=False)
        scales, zeros = scales.to(DTYPE), zeros.to(DTYPE)
        self.w4 = weight_copies([pack_int4(q, w4a16_rows.PACK_BLOCK), scales, zeros])
        self.w4_reference = ((q.float() - zeros.float().repeat_interleave(GROUP, 0))
                             * scales.float().repeat_interleave(GROUP, 0))
        self.counters = split_counters(torch.device("cuda"))  # shared by the copies: their calls run in turn
        self.int8 = self.nf4 = None
        try:
            import bitsandbytes
        except ImportError:
            return
        from loraplex.quantization.bnb.mode import quantized_linear

        int8 = quantized_linear(bitsandbytes, _linear_of(weight), "bitsandbytes", torch.device("cuda"), DTYPE)
        self.int8, self.int8_reference = weight_copies([int8.weight.data, int8.weight_scale.data]), int8.dequantized().t()
        nf4 = quantized_linear(bitsandbytes, _linear_of(weight), "bitsandbytes-nf4", torch.device("cuda"), DTYPE)
        self.nf4 = weight_copies([nf4.weight.data, nf4.absmax.data, nf4.code.data])
        self.nf4_reference = nf4.dequantized_as(DTYPE).float().t()
        self.nf4_shape = [n, k]


def _linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda", dtype=DTYPE)
    linear.weight.data.copy_(weight)
    return linear.requires_grad_(False)


def timed(copies: list[list[torch.Tensor]], product, x: torch.Tensor, reference: torch.Tensor | None,
          target_ms: float) -> tuple[float, float]:
    """(us per call, largest error relative to the reference's largest value)."""
    us = graph_time_us([lambda c=c: product(x, *c) for c in copies], target_ms)
    if reference is None:
        return us, 0.0
    want = x.float() @ reference
    return us, ((product(x, *copies[0]).float() - want).abs().max() / want.abs().max()).item()


def layer_time(linears: list[Linear], m: int, kind: str, target_ms: float) -> tuple[float, float]:
    us, error = 0.0, 0.0
    for linear in linears:
        x = torch.randn(m, linear.k, device="cuda", dtype=DTYPE)
        if kind == "bf16":
            t, e = timed(linear.bf16, lambda x, w: F.linear(x, w), x, None, target_ms)
        elif kind in ("fp8", "int8"):
            t, e = timed(getattr(linear, kind), lambda x, w, s, c=linear.counters: weight_only.matmul(x, w, s, None, c),
                         x, getattr(linear, f"{kind}_reference"), target_ms)
        elif kind == "nf4-gemv":  # bitsandbytes' one-row kernel
            t, e = timed(linear.nf4, lambda x, w, a, code, shape=linear.nf4_shape: torch.ops.bitsandbytes.gemv_4bit.default(
                         x, w.view(-1, 1), shape, a.view(-1), code, 64), x, linear.nf4_reference, target_ms)
        elif kind == "nf4-dequantized":  # bitsandbytes' dequantization, then the bf16 product
            t, e = timed(linear.nf4, lambda x, w, a, code, shape=linear.nf4_shape: F.linear(
                         x, torch.ops.bitsandbytes.dequantize_4bit.default(w.view(-1, 1), a.view(-1), 64, "nf4", shape,
                                                                           DTYPE)), x, linear.nf4_reference, target_ms)
        else:
            t, e = timed(linear.w4, lambda x, q, s, z, c=linear.counters: w4a16_triton.matmul(x, q, s, z, GROUP, None, c),
                         x, linear.w4_reference, target_ms)
        us, error = us + t, max(error, e)
    return us, error


FP8_GRID = {"rows": (("rows",), (32, 64, 128), (4, 8), (2, 4), (4, 8, 16), (False, True)),
            "dot": (("dot",), (32, 64, 128), (4,), (2, 3), (4, 8, 16), (False, True))}
W4_GRID = ((64, 128, 256), (4, 8), (2, 3), (4, 8, 16), (False, True))


# bitsandbytes' int8 weights, up to 64 rows: (kernel, BLOCK_M (dot), BLOCK_N, warps, stages, programs per SM, in-kernel)
BNB_GRID = {"rows": (("rows",), (1,), (32, 64, 128), (4, 8), (2, 4), (4, 8, 16), (False,)),
            "dot": (("dot",), (16, 32, 64), (64, 128), (4, 8), (3, 4), (2, 4, 8), (False,))}


def sweep_weight_only(linears: list[Linear], m: int, kind: str, target_ms: float) -> list:
    """Every launch shape of weight_only's kernels for `kind` ("fp8" or "int8") at m rows."""
    saved = (list(weight_only.CONFIGS), weight_only.IN_KERNEL_REDUCE)
    grids = FP8_GRID if kind == "fp8" else BNB_GRID
    options = []
    try:
        for name, grid in grids.items():
            if name == "rows" and m > 4:
                continue
            if kind == "fp8":
                grid = (grid[0], (16,), *grid[1:])
            for kernel, block_m, block_n, warps, stages, programs, in_kernel in itertools.product(*grid):
                if kernel == "dot" and block_m > max(16, m):
                    continue
                weight_only.CONFIGS = [(64, kernel, block_m, block_n, warps, stages, programs, 1.0)]
                weight_only.IN_KERNEL_REDUCE = in_kernel
                us, error = layer_time(linears, m, kind, target_ms)
                options.append((us, (kernel, block_m, block_n, warps, stages, programs, in_kernel), error))
    finally:
        weight_only.CONFIGS, weight_only.IN_KERNEL_REDUCE = saved
    return sorted(options)


def sweep_w4(linears: list[Linear], m: int, target_ms: float) -> list:
    saved = (list(w4a16_rows.CONFIGS), w4a16_rows.MAX_ROWS, w4a16_rows.IN_KERNEL_REDUCE)
    options = []
    try:
        w4a16_rows.MAX_ROWS = 0  # the tensor-core kernel, as it stands
        us, error = layer_time(linears, m, "w4a16", target_ms)
        options.append((us, ("dot",), error))
        w4a16_rows.MAX_ROWS = 16
        for block_n, warps, stages, programs, in_kernel in itertools.product(*W4_GRID):
            w4a16_rows.CONFIGS = [(16, block_n, warps, stages, programs, 1.0)]
            w4a16_rows.IN_KERNEL_REDUCE = in_kernel
            us, error = layer_time(linears, m, "w4a16", target_ms)
            options.append((us, ("rows", block_n, warps, stages, programs, in_kernel), error))
    finally:
        w4a16_rows.CONFIGS, w4a16_rows.MAX_ROWS, w4a16_rows.IN_KERNEL_REDUCE = saved
    return sorted(options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--w4-rows", default="1,2,4,8", help="the M values the W4A16 sweep covers")
    parser.add_argument("--fp8-rows", default="1,2,4,8,16", help="the M values the FP8 sweep covers")
    parser.add_argument("--int8-rows", default="", help="the M values the bitsandbytes int8 sweep covers")
    parser.add_argument("--nf4-rows", default="", help="the M values bitsandbytes' nf4 kernels are timed at")
    parser.add_argument("--target-ms", type=float, default=4.0, help="replay time per measurement")
    parser.add_argument("--json", help="write the best shapes here too")
    args = parser.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.quantized_rows")) is not None:
        return code
    log(f"quantized per-row kernels' launch shapes on {torch.cuda.get_device_name()}: M {args.rows} "
        "(each M sweeps many launch shapes: tens of minutes)")
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    log("quantizing one 8B layer's linears")
    linears = [Linear(k, n, fp8) for _, k, n in SHAPES]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; one 8B layer's linears "
          f"({', '.join(f'{s} {k}->{n}' for s, k, n in SHAPES)})")
    best = {}
    for m in (int(r) for r in args.rows.split(",")):
        log(f"M={m}: bf16, then the sweeps")
        bf16_us, _ = layer_time(linears, m, "bf16", args.target_ms)
        print(f"\nM={m}: bf16 {bf16_us:.1f} us per layer")
        best[m] = {"bf16_us": bf16_us}
        sweeps = {}
        if fp8 and str(m) in args.fp8_rows.split(","):
            sweeps["fp8"] = sweep_weight_only(linears, m, "fp8", args.target_ms)
        if linears[0].int8 is not None and str(m) in args.int8_rows.split(","):
            sweeps["int8"] = sweep_weight_only(linears, m, "int8", args.target_ms)
        if str(m) in args.w4_rows.split(","):
            sweeps["w4a16"] = sweep_w4(linears, m, args.target_ms)
        if linears[0].nf4 is not None and str(m) in args.nf4_rows.split(","):  # bitsandbytes' own paths beside
            for kind in (["nf4-gemv"] if m == 1 else []) + ["nf4-dequantized"]:
                us, error = layer_time(linears, m, kind, args.target_ms)
                sweeps[kind] = [(us, (kind,), error)]
        for kind, options in sweeps.items():
            for us, option, error in options[:3]:
                print(f"  {kind:6s} {us:8.1f} us  {bf16_us / us:5.2f}x bf16  err {error:.1e}  {option}")
            if options:
                dot = [o for o in options if o[1][0] == "dot"]
                if dot:
                    print(f"  {kind:6s} best dot {dot[0][0]:.1f} us ({bf16_us / dot[0][0]:.2f}x) {dot[0][1]}")
                best[m][kind] = {"us": options[0][0], "x_bf16": bf16_us / options[0][0], "option": options[0][1],
                                 "error": max(o[2] for o in options)}
    print("\nbest:", json.dumps(best))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(best, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
