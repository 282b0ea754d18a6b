"""Adapter uploads in one copy: every module's A [r, in] and B.T [r, out] in one flat buffer (in the slots' dtype,
laid out as `layout.Layout` says), copied to one device allocation (`Uploaded`). The per-module views of it are
made only when asked for (`Uploaded.weights`, by the segment forms): the slot tables point into the buffer from the
layout's offsets and the tile and per-row kernels read nothing else, while the 420 views of a 135M-parameter
model's adapter cost more host time than its copy.

An adapter loaded from disk (or merged) is already laid out so on the host (`LoraAdapter.flat`): its upload is one
copy into a staging buffer (pinned on CUDA, so the copy to the device does not block the host; converting to the
slots' dtype on the way) and one copy to the device. Other adapters (built by hand) take one pass over their
tensors into the staging buffer first.

On CUDA the copy to the device runs on a side stream: installs happen while a decode step is in flight
(engine/worker/overlap.py), and a copy queued behind that step on the main stream would make the next step wait for both
in turn. The main stream waits for the copy on the device (the host never does); the weights' buffer is allocated
on the side stream, so it cannot be a block a running step still reads, and is marked as used by the main stream,
so its memory is not handed out again before the steps that read it are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from loraplex.lora.layout import Layout
from loraplex.lora.packed import PackedModules
from loraplex.lora.weights import LoraWeights


@dataclass(frozen=True, eq=False)
class Uploaded:
    """An adapter's weights on the device: one buffer laid out as `layout` says, and each module's scale in the
    layout's order."""

    buffer: torch.Tensor
    layout: Layout
    scales: tuple[float, ...]

    def weights(self) -> dict[str, LoraWeights]:
        """module name -> its weights, as views of the buffer."""
        return {name: LoraWeights(a, b, scale)
                for (name, (a, b)), scale in zip(self.layout.views(self.buffer).items(), self.scales)}


class AdapterUploader:
    """Copies adapters to `device` in `dtype`, one buffer each."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._staged = device.type != "cpu"  # on the CPU the layout is written straight into the weights' buffer
        self._pinned = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # where the copies run

    def upload(self, modules: Mapping[str, LoraWeights], flat: torch.Tensor | None = None,
               layout: Layout | None = None, staged: torch.Tensor | None = None) -> Uploaded:
        """The weights of `modules` on the device, in one fresh allocation laid out for the kernels. `flat`: the one
        buffer `modules` are views of, when they are (`LoraAdapter.flat`); `layout`: theirs, when known; `staged`:
        what `stage` made of them, when it was called ahead."""
        layout = layout if layout is not None else Layout.of(modules)
        laid_out = staged if staged is not None else self.stage(modules, flat, layout)
        buffer = self._to_device(laid_out) if laid_out.is_cpu and self.device.type != "cpu" else laid_out
        return Uploaded(buffer, layout, module_scales(modules))

    def stage(self, modules: Mapping[str, LoraWeights], flat: torch.Tensor | None, layout: Layout) -> torch.Tensor:
        """The host half of an upload: the weights laid out in the slots' dtype, in a fresh buffer (pinned host
        memory on CUDA; on the device already when the weights are, or on the CPU), or the adapter's own buffer when
        it is laid out so already (`takes_as_is`). Thread-safe: `StagedUploads`
        runs it ahead of the install, on its own thread."""
        if flat is not None and self.takes_as_is(flat):
            return flat
        source = [flat] if flat is not None else [t for w in modules.values() for t in (w.a, w.b)]
        # Weights already on a GPU (a benchmark's, built there) are laid out there: no round trip through the host.
        staged = self._staged and any(t.is_cpu for t in source)
        # A fresh pinned buffer per upload: the caching host allocator reuses it only once its copy is done.
        target = torch.empty(layout.length, dtype=self.dtype, pin_memory=self._pinned) if staged else \
            torch.empty(layout.length, dtype=self.dtype, device=self.device)
        if flat is not None:
            assert flat.numel() == layout.length, "the adapter's flat buffer is not laid out as its modules are"
            target.copy_(flat)
        else:
            for name, (a, b) in layout.views(target).items():
                a.copy_(modules[name].a)
                b.copy_(modules[name].b)
        return target

    def takes_as_is(self, flat: torch.Tensor) -> bool:
        """Whether an adapter's flat buffer is already what its slot needs: in the slots' dtype, in host memory,
        pinned where copies to the device are asynchronous (the store lays adapters out so: lora/layout.py
        FlatFormat). Staging it then copies nothing: a GPU's copy reads it, and a CPU slot reads the adapter's own
        buffer (nothing writes to either: the slots' weights are read-only, and an adapter's are its own)."""
        if flat.dtype != self.dtype or not flat.is_cpu:
            return False
        return not self._pinned or flat.is_pinned()

    def _to_device(self, staging: torch.Tensor) -> torch.Tensor:
        """`staging` copied to a fresh device buffer; on CUDA, on the side stream (see the module's notes)."""
        if self.stream is None:
            return staging.to(self.device)
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            buffer = torch.empty_like(staging, device=self.device)
            buffer.copy_(staging, non_blocking=True)
        main.wait_stream(self.stream)
        buffer.record_stream(main)
        return buffer


def module_scales(modules: Mapping[str, LoraWeights]) -> tuple[float, ...]:
    """Each module's scale, in the modules' order (a packed adapter's without making its views)."""
    if isinstance(modules, PackedModules):
        return tuple(modules.scales[name] for name in modules)
    return tuple(w.scale for w in modules.values())


def laid_out(weights: LoraWeights) -> LoraWeights:
    """One module's weights as an install lays them out, on their own device and in their own dtype (for kernel
    tests and benchmarks that fill slot tables by hand)."""
    return AdapterUploader(weights.a.device, weights.a.dtype).upload({"": weights}).weights()[""]
