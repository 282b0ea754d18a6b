"""The per-row LoRA shrink beside the base product, in a CUDA graph being captured.

A decode step over many adapters launches, per layer, a shrink and an expand for each of four projection groups
(`kernels/bgmv.py`): short kernels, each with a ramp and a tail of its own. The shrink reads only the layer's
input, so it need not wait for the base product: forked onto a second stream before the product and joined after
it, it runs while the product reads the weights, and only the expand (which adds to the product) stays behind it.
In a graph the fork and join are edges, not host work. `python -m benchmarks.lora_step` measures it (figures in
docs/benchmarks.md).

Only in graphs (and the eager pass before a capture): an eager step would pay two stream switches per group on
the host, and eager steps are the ones bound by the host. The partial sums are allocated on the side stream; every
later use of their memory is ordered after the join (the next fork waits for the main stream), so no
`record_stream` is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from loraplex.layers.forward_context import in_graph_warm_up
from loraplex.lora.step.kernels.rows import fits

if TYPE_CHECKING:
    from loraplex.lora.step.kernels.bgmv import RowShrink

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def in_graph(x: torch.Tensor) -> bool:
    """Whether `x`'s work is being captured into a CUDA graph, or is the eager pass just before a capture (which
    takes the path the capture will, so that the side stream exists and the kernels are compiled before it)."""
    return x.is_cuda and (torch.cuda.is_current_stream_capturing() or in_graph_warm_up())


@dataclass(frozen=True)
class ShrinkBeside:
    """A shrink launched on the side stream for the siblings at positions `targeted` of a product; `expand` joins
    it and adds their deltas on the main stream."""

    shrink: RowShrink
    side: torch.cuda.Stream
    targeted: tuple[int, ...]

    def expand(self, product_outs: Sequence[torch.Tensor]) -> None:
        """Adds the deltas to the product's outputs (every sibling's, in order; the untargeted take nothing)."""
        outs = [product_outs[i] for i in self.targeted]
        assert fits(self.shrink.launch, outs), "the expand's outputs must be the columns its shrink was planned for"
        torch.cuda.current_stream(self.side.device).wait_stream(self.side)
        self.shrink.expand(outs)


def shrink_beside(offsets: Sequence[int], widths: Sequence[int], x: torch.Tensor, row_slots: torch.Tensor,
                  tables, names: Sequence[str], max_rank: int, targeted: Sequence[int] | None = None) -> ShrinkBeside:
    """Fork: the shrink of `names`' deltas on x, for outputs that will be the columns `offsets`, `widths` of the
    base product, on the side stream after everything queued so far on the current one. `targeted`: the positions
    of those outputs among the product's (default: all of them, in order)."""
    from loraplex.lora.step.kernels.bgmv import shrink_rows_at  # Triton: CUDA only

    side = _side_streams.get(x.device)
    if side is None:
        side = _side_streams[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        shrink = shrink_rows_at(offsets, widths, x, row_slots, tables, names, max_rank)
    return ShrinkBeside(shrink, side, tuple(range(len(names)) if targeted is None else targeted))
