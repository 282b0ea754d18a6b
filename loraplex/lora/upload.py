"""Adapter uploads in one copy: every module's A [r, in] and B.T [r, out] laid out in one flat host buffer (in the
slots' dtype), copied to one device allocation, and handed back as views of it.

An install used to copy each tensor on its own: a few hundred small synchronous host-to-device copies, relayouts
and allocations per adapter. With 1,000 adapters wanted through 128 slots that cost more host time than the
steps themselves (the online benchmark's profile, docs/benchmarks.md). Now it is one pass over the host tensors
into a staging buffer (pinned on CUDA, so the copy does not block the host) and one copy.

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
    """Copies adapters to `device` in `dtype`, one buffer each. Owns the host staging buffer, reused across
    uploads (the next upload waits for the previous copy out of it to finish)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._staged = device.type != "cpu"  # on the CPU the layout is written straight into the weights' buffer
        self._pinned = device.type == "cuda"
        self._staging = torch.empty(0, dtype=dtype)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the staging buffer

    def upload(self, modules: Mapping[str, LoraWeights]) -> dict[str, LoraWeights]:
        """The weights of `modules` on the device: views of one fresh allocation, laid out for the kernels."""
        offsets, length = layout(modules)
        buffer = torch.empty(length, dtype=self.dtype, device=self.device)
        # Weights already on a GPU (a benchmark's, built there) are laid out there: no round trip through the host.
        staged = self._staged and any(t.is_cpu for w in modules.values() for t in (w.a, w.b))
        staging = self._staging_of(length) if staged else buffer
        for name, w in modules.items():
            a, b_t = _placed(staging, offsets[name], w)
            a.copy_(w.a)
            b_t.copy_(w.b.t())
        if staged:
            buffer.copy_(staging[:length], non_blocking=self._pinned)
            if self._pinned:
                self._copied = torch.cuda.Event()
                self._copied.record()
        uploaded = {}
        for name, w in modules.items():
            a, b_t = _placed(buffer, offsets[name], w)
            uploaded[name] = LoraWeights(a, b_t.t(), w.scale)
        return uploaded

    def _staging_of(self, length: int) -> torch.Tensor:
        """The staging buffer, at least `length` long, once the previous copy out of it is done."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._staging.numel() < length:
            self._staging = torch.empty(max(length, 2 * self._staging.numel()), dtype=self.dtype,
                                        pin_memory=self._pinned)
        return self._staging


def laid_out(weights: LoraWeights) -> LoraWeights:
    """One module's weights as an install lays them out, on their own device and in their own dtype (for kernel
    tests and benchmarks that fill slot tables by hand)."""
    return AdapterUploader(weights.a.device, weights.a.dtype).upload({"": weights})[""]
