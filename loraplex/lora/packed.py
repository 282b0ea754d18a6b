"""An adapter's modules as views of its one flat buffer, made when asked for.

A loaded adapter held as a dict of `LoraWeights` keeps ~640 objects that Python's garbage collector tracks (for a
135M model's seven projections: 210 weights, 420 tensor views), and a full collection walks every one: a store of
1,000 adapters added ~640,000 objects to each full collection, a pause of the engine thread mid-step. A
`PackedModules` is a mapping over the buffer and its layout (`layout.Layout`) with a few tracked objects; a module's
views are made when it is read (an install reads none: it copies the buffer and points the slot tables from the
layout).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

from loraplex.lora.layout import Layout
from loraplex.lora.weights import LoraWeights


class PackedModules(Mapping[str, LoraWeights]):
    """module name -> its weights, as views of `flat` laid out as `layout` says; `scales`: each module's."""

    __slots__ = ("flat", "layout", "scales")

    def __init__(self, flat: torch.Tensor, layout: Layout, scales: Mapping[str, float]) -> None:
        assert scales.keys() == layout.entries.keys(), "a scale for every module of the layout, and no other"
        self.flat, self.layout, self.scales = flat, layout, dict(scales)

    def __getitem__(self, name: str) -> LoraWeights:
        a, b = self.layout.view(self.flat, name)  # KeyError for a module it does not hold
        return LoraWeights(a, b, self.scales[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.entries)

    def __len__(self) -> int:
        return len(self.layout.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.layout.entries

    def __repr__(self) -> str:
        return f"PackedModules({len(self)} modules, {self.flat.numel()} elements of {self.flat.dtype})"

    @property
    def max_rank(self) -> int:
        return max((entry[1] for entry in self.layout.entries.values()), default=0)

    @property
    def nbytes(self) -> int:
        """The weights' bytes (the buffer's alignment gaps not counted)."""
        count = sum(rank * (n_in + n_out) for _, rank, n_in, _, n_out in self.layout.entries.values())
        return count * self.flat.element_size()
