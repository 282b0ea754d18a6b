"""Where an adapter's weights lie in one flat buffer: each module's A [r, in] and then its B.T [r, out], module after
module, each starting at a multiple of `ALIGN` elements, so that its address is 16-byte aligned as the per-row
kernels load it.

An adapter's host copy is laid out so when it loads (`LoraAdapter.packed`), and each device copy of it is (the
slots' weights, `upload.AdapterUploader`): installing an adapter is then one copy of one buffer, whatever the
number of its modules. With 1,000 adapters wanted through 128 slots, a copy per tensor cost more host time than
the steps (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

ALIGN = 64  # elements: 128 bytes in bfloat16, 256 in float32


@dataclass(frozen=True)
class FlatFormat:
    """How loaded adapters keep their flat buffer in host memory. For a GPU engine, the slots' dtype in pinned memory:
    the conversion is then done where the adapter loads (off the engine's thread) and its install is one copy, from
    that buffer straight to the device. The default (float32, pageable) keeps the weights as PEFT computes them."""

    dtype: torch.dtype = torch.float32
    pinned: bool = False


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, eq=False)
class Layout:
    """module name -> (offset of A, rank, in_features, offset of B.T, out_features), in elements; `length`: the
    buffer's. The same per module as tensors, in the entries' order, for the slot tables (`PointerTable`), which
    point at a buffer's modules without a Python pass over them: `offsets` [M, 2] int64 (A's, B.T's) and `ranks` [M]
    int32. `gaps`: the (start, end) spans no module covers (the alignment's padding), non-empty ones only."""

    entries: dict[str, tuple[int, int, int, int, int]]
    length: int
    offsets: torch.Tensor
    ranks: torch.Tensor
    gaps: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, modules: Mapping[str, Any]) -> "Layout":
        """The layout of `modules` (name -> anything with `a` [r, in] and `b` [out, r]), in their order."""
        entries, end, spans = {}, 0, []
        for name, w in modules.items():
            rank, in_features = w.a.shape
            out_features = w.b.shape[0]
            a_at = end
            b_at = a_at + _aligned(rank * in_features)
            end = b_at + _aligned(rank * out_features)
            entries[name] = (a_at, rank, in_features, b_at, out_features)
            spans += [(a_at + rank * in_features, b_at), (b_at + rank * out_features, end)]
        offsets = torch.tensor([(e[0], e[3]) for e in entries.values()], dtype=torch.int64).reshape(-1, 2)
        ranks = torch.tensor([e[1] for e in entries.values()], dtype=torch.int32)
        return cls(entries, end, offsets, ranks, tuple((a, b) for a, b in spans if a < b))

    def empty(self, dtype: torch.dtype, device: torch.device | str = "cpu", pinned: bool = False) -> torch.Tensor:
        """A buffer of this layout whose padding is zero (no stray bytes: the fingerprint hashes it) and whose modules'
        spans are left for the caller to fill: one pass over the memory, not two."""
        buffer = torch.empty(self.length, dtype=dtype, device=device, pin_memory=pinned)
        for start, end in self.gaps:
            buffer[start:end].zero_()
        return buffer

    def views(self, buffer: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """module name -> (A [r, in], B [out, r]) as views of `buffer` (B the transposed view of its dense B.T)."""
        assert buffer.dim() == 1 and buffer.numel() >= self.length and buffer.is_contiguous()
        return {name: self._view(buffer, entry) for name, entry in self.entries.items()}

    def view(self, buffer: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One module's (A, B) as `views` gives them."""
        assert buffer.dim() == 1 and buffer.numel() >= self.length and buffer.is_contiguous()
        return self._view(buffer, self.entries[name])

    @staticmethod
    def _view(buffer: torch.Tensor, entry: tuple[int, int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        a_at, rank, n_in, b_at, n_out = entry
        base = buffer.storage_offset()
        return (buffer.as_strided((rank, n_in), (n_in, 1), base + a_at),
                buffer.as_strided((n_out, rank), (1, n_out), base + b_at))
