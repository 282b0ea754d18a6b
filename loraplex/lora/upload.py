"""Adapter uploads in one copy: every module's A [r, in] and B.T [r, out] laid out in one flat host buffer (in the
slots' dtype), copied to one device allocation, and handed back as views of it.

An install used to copy each tensor on its own: a few hundred small synchronous host-to-device copies, relayouts
and allocations per adapter. With 1,000 adapters wanted through 128 slots that cost more host time than the
steps themselves (the online benchmark's profile, docs/benchmarks.md). Now it is one pass over the host tensors
into a staging buffer (pinned on CUDA, so the copy does not block the host) and one copy.

On CUDA that copy runs on a side stream: installs happen while a decode step is in flight (engine/overlap.py),
and a copy queued behind that step on the main stream would make the next step wait for both in turn. The main
stream waits for the copy on the device (the host never does); the weights' buffer is allocated on the side stream,
so it cannot be a block a running step still reads, and is marked as used by the main stream, so its memory is not
handed out again before the steps that read it are done.

Each tensor starts at a multiple of `ALIGN` elements of the buffer, so its address is 16-byte aligned, as the
per-row kernels need (`SlotPointers` checks); B is handed back as B.T's transposed view, the layout they read.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loraplex.lora.adapter import LoraWeights

ALIGN = 64  # elements: 128 bytes in bfloat16, 256 in float32


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(modules: Mapping[str, LoraWeights]) -> tuple[dict[str, tuple[int, int]], int]:
    """module name -> (offset of A, offset of B.T) in elements, and the buffer's length."""
    offsets, end = {}, 0
    for name, w in modules.items():
        a_at = end
        b_at = a_at + _aligned(w.a.numel())
        end = b_at + _aligned(w.b.numel())
        offsets[name] = (a_at, b_at)
    return offsets, end


def _placed(buffer: torch.Tensor, offsets: tuple[int, int], w: LoraWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `w`'s A [r, in] and B.T [r, out] lie in `buffer`, given their offsets."""
    a_at, b_at = offsets
    a = buffer[a_at : a_at + w.a.numel()].view(w.rank, w.a.shape[1])
    b_t = buffer[b_at : b_at + w.b.numel()].view(w.rank, w.b.shape[0])
    return a, b_t


class AdapterUploader:
    """Copies adapters to `device` in `dtype`, one buffer each."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._staged = device.type != "cpu"  # on the CPU the layout is written straight into the weights' buffer
        self._pinned = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # where the copies run

    def upload(self, modules: Mapping[str, LoraWeights]) -> dict[str, LoraWeights]:
        """The weights of `modules` on the device: views of one fresh allocation, laid out for the kernels."""
        offsets, length = layout(modules)
        # Weights already on a GPU (a benchmark's, built there) are laid out there: no round trip through the host.
        staged = self._staged and any(t.is_cpu for w in modules.values() for t in (w.a, w.b))
        # A fresh pinned buffer per upload: the caching host allocator reuses it only once its copy is done.
        target = torch.empty(length, dtype=self.dtype, pin_memory=self._pinned) if staged else \
            torch.empty(length, dtype=self.dtype, device=self.device)
        for name, w in modules.items():
            a, b_t = _placed(target, offsets[name], w)
            a.copy_(w.a)
            b_t.copy_(w.b.t())
        buffer = self._to_device(target) if staged else target
        uploaded = {}
        for name, w in modules.items():
            a, b_t = _placed(buffer, offsets[name], w)
            uploaded[name] = LoraWeights(a, b_t.t(), w.scale)
        return uploaded

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


def laid_out(weights: LoraWeights) -> LoraWeights:
    """One module's weights as an install lays them out, on their own device and in their own dtype (for kernel
    tests and benchmarks that fill slot tables by hand)."""
    return AdapterUploader(weights.a.device, weights.a.dtype).upload({"": weights})[""]
