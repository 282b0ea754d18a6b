"""A decode step's projections at the 8B shape with the per-row LoRA kernels, in a CUDA graph:
`python -m benchmarks.lora_step`. CUDA only.

32 layers of q/k/v, o, gate/up and down products over 64 rows, each row its own rank-16 adapter on all seven
projections (64 distinct adapters, each in one flat buffer as installs lay them out, so a layer's reads are spread
over 64 buffers as in the engine). Replayed: the products alone, then with the deltas added after each product
(`add_lora_rows_siblings`), then with each shrink beside its product (`lora/step/beside.py`). The LoRA time is the
difference from the products alone, against the adapters' bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.progress import needs_cuda, progress
from loraplex.lora.adapter import LoraWeights
from loraplex.lora.step.beside import shrink_beside
from loraplex.lora.step.kernels import PointerTable

HIDDEN, KV, FFN, RANK, ROWS, LAYERS, ADAPTERS = 4096, 1024, 14336, 16, 64, 32, 64
# (group, input features, its layers' widths): one product each
GROUPS = [("qkv", HIDDEN, (HIDDEN, KV, KV)), ("o", HIDDEN, (HIDDEN,)), ("gate_up", HIDDEN, (FFN, FFN)),
          ("down", FFN, (HIDDEN,))]
MODES = ("products alone", "deltas after", "shrink beside")


def build(device: torch.device, dtype: torch.dtype):
    """Per layer: the groups' weights and slot tables; and the adapters' buffers (kept alive: the tables hold only
    addresses)."""
    modules = [(f"{g}.{k}", n_in, width) for g, n_in, widths in GROUPS for k, width in enumerate(widths)]
    per_layer = sum(RANK * (n_in + width) for _, n_in, width in modules)
    buffers = [torch.randn(LAYERS * per_layer, device=device, dtype=dtype) * 0.01 for _ in range(ADAPTERS)]
    layers = []
    for layer in range(LAYERS):
        weights = {g: torch.randn(sum(widths), n_in, device=device, dtype=dtype) * 0.01 for g, n_in, widths in GROUPS}
        tables = PointerTable([name for name, _, _ in modules], ADAPTERS, device)
        for slot, buffer in enumerate(buffers):
            at, views = layer * per_layer, {}
            for name, n_in, width in modules:  # A [r, in], then B.T [r, out]
                a = buffer[at:at + RANK * n_in].view(RANK, n_in)
                b = buffer[at + RANK * n_in:at + RANK * (n_in + width)].view(RANK, width).t()
                views[name] = LoraWeights(a, b, 2.0)
                at += RANK * (n_in + width)
            tables.set_slot(slot, views)
        layers.append((weights, tables))
    return layers, buffers, per_layer * LAYERS * ADAPTERS * dtype.itemsize


def step(layers, mode: str, xs, outs, row_slots) -> None:
    from loraplex.lora.step.kernels.bgmv import add_lora_rows_siblings  # Triton: CUDA only

    for weights, tables in layers:
        for g, _, widths in GROUPS:
            names = [f"{g}.{k}" for k in range(len(widths))]
            offsets = [sum(widths[:k]) for k in range(len(widths))]
            early = shrink_beside(offsets, widths, xs[g], row_slots, tables, names, RANK) if mode == MODES[2] else None
            torch.matmul(xs[g], weights[g].t(), out=outs[g])
            if early is not None:
                early.expand(outs[g].split(widths, dim=1))
            elif mode == MODES[1]:
                add_lora_rows_siblings(outs[g].split(widths, dim=1), xs[g], row_slots, tables, names, RANK)


def replay_ms(layers, mode: str, device: torch.device, dtype: torch.dtype, replays: int = 30) -> float:
    """Median milliseconds of one replay of the step captured in `mode`."""
    xs = {g: torch.randn(ROWS, n_in, device=device, dtype=dtype) for g, n_in, _ in GROUPS}
    outs = {g: torch.empty(ROWS, sum(widths), device=device, dtype=dtype) for g, _, widths in GROUPS}
    row_slots = torch.arange(ROWS, device=device, dtype=torch.int32) % ADAPTERS
    step(layers, mode, xs, outs, row_slots)  # compiles the kernels, makes the side stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layers, mode, xs, outs, row_slots)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.lora_step")) is not None:
        return code
    log(f"a decode step's projections with per-row LoRA, 8B shape, on {torch.cuda.get_device_name()}: "
        f"3 rounds of {len(MODES)} modes (about a minute)")
    device, dtype = torch.device("cuda"), torch.bfloat16
    log(f"building {LAYERS} layers' weights and {ADAPTERS} adapters")
    layers, buffers, lora_bytes = build(device, dtype)
    print(f"load average {os.getloadavg()[0]:.1f}; adapters' bytes per step {lora_bytes / 1e9:.2f} GB", flush=True)
    for round_ in range(3):  # the first round also warms the GPU's clocks
        log(f"round {round_}: capturing and replaying each mode")
        ms = {mode: replay_ms(layers, mode, device, dtype) for mode in MODES}
        base = ms[MODES[0]]
        print(f"round {round_}: products alone {base:.3f} ms; " + "; ".join(
            f"{mode} +{ms[mode] - base:.3f} ms ({(ms[mode] - base) / LAYERS * 1e3:.1f} us a layer, "
            f"{lora_bytes / (ms[mode] - base) / 1e6:,.0f} GB/s)" for mode in MODES[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
