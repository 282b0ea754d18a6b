"""What LoRA costs the host in an eager step and an install, at SmolLM2-135M's shapes: `python -m
benchmarks.lora_host_costs`. On CUDA (the tile kernels are Triton; elsewhere only under Triton's interpreter).

- A sibling call (q/k/v of one layer): the tile kernels' launch pair (`sgmv.add_lora_tiles_siblings`) against a
  matmul pair per module (`add_lora`), for one adapter and for eight, at 256 to 4,096 rows; the tile kernels both
  launched directly (`kernels/launch.py`, the default) and through Triton's own path. Back-to-back calls
  with no synchronisation: a figure is the host's cost per call where the host is the slower side, the GPU's
  where the GPU is.
- An install of a rank-16 adapter on all seven projections of 30 layers (210 modules): the upload from the
  adapter's flat buffer, pointing a slot at it from its layout (`PointerTable.set_slot_uploaded`) against from
  per-module views (`set_slot`), and the 420 views themselves (made only where a segment form asks for them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time

import torch

from benchmarks.progress import progress
from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.step.kernels import PointerTable, add_lora
from loraplex.lora.step.kernels.tiles import lora_tiles
from loraplex.lora.device.upload import AdapterUploader, laid_out

DTYPE = torch.bfloat16
RANK = 16
HIDDEN = 576
QKV = {"q": 576, "k": 192, "v": 192}
PROJECTIONS = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
               "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
LAYERS = 30


def microseconds(fn, calls: int = 200) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(5):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


@contextlib.contextmanager
def through_triton(*launchers):
    """The launchers' calls take Triton's own launch path meanwhile."""
    saved = [launcher.direct for launcher in launchers]
    for launcher in launchers:
        launcher.direct = False
    try:
        yield
    finally:
        for launcher, direct in zip(launchers, saved):
            launcher.direct = direct


def sibling_calls(device: torch.device) -> None:
    from loraplex.lora.step.kernels import sgmv  # Triton: CUDA only

    g = torch.Generator(device=device).manual_seed(0)
    slots = 8
    weights = {name: [laid_out(LoraWeights(torch.randn(RANK, HIDDEN, generator=g, device=device).to(DTYPE),
                                           torch.randn(width, RANK, generator=g, device=device).to(DTYPE), 2.0))
                      for _ in range(slots)] for name, width in QKV.items()}
    tables = PointerTable(list(QKV), slots, device)
    for slot in range(slots):
        tables.set_slot(slot, {name: weights[name][slot] for name in QKV})
    print("q/k/v LoRA of one layer, per call (us):")
    print("| rows | adapters | matmul pair per module | tile kernels | tile kernels through Triton's path |\n"
          "|---:|---:|---:|---:|---:|")
    for rows in (256, 1024, 4096):
        x = torch.randn(rows, HIDDEN, device=device, dtype=DTYPE)
        fused = torch.randn(rows, sum(QKV.values()), device=device, dtype=DTYPE)
        outs = fused.split(list(QKV.values()), dim=-1)
        for adapters in (1, slots):
            per = rows // adapters
            segments = [LoraSegment(s, s * per, (s + 1) * per) for s in range(adapters)]
            tiles = lora_tiles(segments, device)
            dense = microseconds(lambda: [add_lora(out, x, segments, weights[name])
                                          for name, out in zip(QKV, outs)])
            def tiled():
                sgmv.add_lora_tiles_siblings(outs, x, tiles, tables, list(QKV), RANK)

            direct = microseconds(tiled)
            with through_triton(sgmv._shrink, sgmv._expand):
                triton_path = microseconds(tiled)
            print(f"| {rows} | {adapters} | {dense:.1f} | {direct:.1f} | {triton_path:.1f} |")


def installs(device: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    modules = {f"model.layers.{layer}.{name}": LoraWeights(torch.randn(RANK, n_in, generator=g),
                                                           torch.randn(n_out, RANK, generator=g), 2.0)
               for layer in range(LAYERS) for name, (n_in, n_out) in PROJECTIONS.items()}
    adapter = LoraAdapter("bench", modules, LoraConfig(r=RANK, lora_alpha=2 * RANK)).packed()  # float32, as loaded
    uploader = AdapterUploader(device, DTYPE)
    tables = PointerTable(list(modules), 128, device)
    uploaded = uploader.upload(adapter.modules, adapter.flat, adapter.layout)
    views = uploaded.weights()
    print(f"\nan install of {len(modules)} modules ({adapter.flat.numel() * 2 / 1e6:.1f} MB in {DTYPE}), per call (us):")
    print("| step | us |\n|---|---:|")
    for label, fn in [
        ("upload from the flat buffer (converting copy to pinned staging, copy to the device)",
         lambda: uploader.upload(adapter.modules, adapter.flat, adapter.layout)),
        ("slot tables from the layout (`set_slot_uploaded`)", lambda: tables.set_slot_uploaded(5, uploaded)),
        ("slot tables from per-module views (`set_slot`)", lambda: tables.set_slot(5, views)),
        ("the per-module views (`Uploaded.weights`)", uploaded.weights),
    ]:
        print(f"| {label} | {microseconds(fn, calls=50):.0f} |")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    log = progress()
    # On a machine without CUDA: a check of the code paths only, under Triton's interpreter (TRITON_INTERPRET=1).
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
    if not torch.cuda.is_available() and not interpreted:
        print("benchmarks.lora_host_costs needs a CUDA device (its tile kernels are Triton; without CUDA only under "
              "Triton's interpreter: TRITON_INTERPRET=1 with triton installed)", file=sys.stderr, flush=True)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu, under Triton's interpreter"
    log(f"LoRA's host costs at SmolLM2-135M's shapes on {where}: sibling calls at 3 row counts, then an install "
        "(about a minute)")
    log("sibling calls (the first compiles the tile kernels)")
    sibling_calls(device)
    log("an install of a rank-16 adapter on 210 modules")
    installs(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
