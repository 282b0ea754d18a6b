"""The per-row LoRA form: each row names its adapter slot, and per-slot tables say where that slot's weights
live on the device.

`PointerTable` holds, for every LoRA layer and slot, the addresses of the slot's A [r, in] and B.T [r, out] (each
dense, row-major, 16-byte aligned: `lora/layout.py` lays them out so), its rank (0: the slot's adapter does not target the layer, or the slot is empty) and its scale.
Installing an adapter rewrites its slot's entries and nothing else: a kernel that reads the tables (and a CUDA
graph that captured it) sees the new adapter at its next launch, whatever its rank. The tables hold addresses
only; the owner (`AdapterTable`) keeps the tensors alive while their slot holds them.

`add_lora_rows_reference` is the plain torch definition of the form, from the weights themselves; the Triton
kernel (`bgmv.py`) must match it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from loraplex.lora.adapter import LoraWeights
from loraplex.lora.device.upload import Uploaded


class PointerTable:
    """Device tables, per layer (in `names` order) and slot: `pointers` [L, S, 2] int64 (A's and B's data
    pointers), `ranks` [L, S] int32, `scales` [L, S] float32. Host copies are the ones written; `set_slot` copies
    them to the device in one go."""

    def __init__(self, names: Sequence[str], num_slots: int, device: torch.device) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.num_slots = num_slots
        shape = (len(names), num_slots)
        self._host = (torch.zeros(*shape, 2, dtype=torch.int64), torch.zeros(shape, dtype=torch.int32),
                      torch.zeros(shape, dtype=torch.float32))
        self.pointers, self.ranks, self.scales = (t.to(device) for t in self._host)
        self.targeted: frozenset[str] = frozenset()  # the layers some slot's adapter targets
        self._deferred = 0  # > 0: inside `deferred`, the device copy waits for its end
        self._stale = False  # a slot was set inside `deferred`: the device tables are behind the host's

    @contextlib.contextmanager
    def deferred(self):
        """Slots set inside reach the device tables in one copy at the end, if any was set (a step's installs: a
        copy of the whole tables per install cost more than the entries)."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
            if not self._deferred and self._stale:
                self._to_device()

    def set_slot(self, slot: int, weights: Mapping[str, LoraWeights | None]) -> None:
        """Point `slot` at these weights (on the tables' device, contiguous); layers absent or None: rank 0."""
        present = {name: w for name, w in weights.items() if w is not None}
        for w in present.values():
            assert w.a.is_contiguous() and w.b.t().is_contiguous(), "the kernels read A and B.T as dense row-major"
            assert w.a.data_ptr() % 16 == 0 and w.b.data_ptr() % 16 == 0, "the kernels load A and B.T 16 bytes at a time"
        addresses = torch.tensor([(w.a.data_ptr(), w.b.data_ptr()) for w in present.values()], dtype=torch.int64)
        self._point(slot, list(present), addresses.reshape(-1, 2),
                    torch.tensor([w.rank for w in present.values()], dtype=torch.int32), [w.scale for w in present.values()])

    def set_slot_uploaded(self, slot: int, uploaded: Uploaded) -> None:
        """Point `slot` at an upload's modules, from its layout's offsets (no pass over per-module tensors)."""
        buffer = uploaded.buffer
        assert buffer.device == self.pointers.device and buffer.is_contiguous() and buffer.data_ptr() % 16 == 0, \
            "the layout aligns each module from the buffer's start"
        addresses = buffer.data_ptr() + uploaded.layout.offsets * buffer.element_size()
        self._point(slot, list(uploaded.layout.entries), addresses, uploaded.layout.ranks, list(uploaded.scales))

    def _point(self, slot: int, names: list[str], addresses: torch.Tensor, ranks: torch.Tensor,
               scales: list[float]) -> None:
        """Write `slot`'s entries (`names`' A and B.T addresses [M, 2], ranks, scales; every other layer's: none)
        and copy the tables to the device (now, or at the end of `deferred`)."""
        layers = torch.tensor([self.index[name] for name in names], dtype=torch.int64)
        host_pointers, host_ranks, host_scales = self._host
        host_pointers[:, slot] = 0
        host_ranks[:, slot] = 0
        host_scales[:, slot] = 0.0
        host_pointers[layers, slot] = addresses
        host_ranks[layers, slot] = ranks
        host_scales[layers, slot] = torch.tensor(scales, dtype=torch.float32)
        if self._deferred:
            self._stale = True
        else:
            self._to_device()

    def _to_device(self) -> None:
        # From a pinned snapshot, without blocking: a step may be in flight (engine/worker/overlap.py), and a copy from
        # pageable memory would make the host wait for it. Queued on the stream, the copy lands after that step
        # (which keeps the entries it was launched with) and before the next.
        for device_table, host_table in zip((self.pointers, self.ranks, self.scales), self._host):
            snapshot = host_table.pin_memory() if device_table.is_cuda else host_table
            device_table.copy_(snapshot, non_blocking=device_table.is_cuda)
        targeted = (self._host[1] != 0).any(dim=1).tolist()
        self.targeted = frozenset(name for name, i in self.index.items() if targeted[i])
        self._stale = False

    def layer(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's tables: pointers [S, 2], ranks [S], scales [S] (views of the device tables)."""
        i = self.index[name]
        return self.pointers[i], self.ranks[i], self.scales[i]


def add_lora_rows_reference(
    out: torch.Tensor, x: torch.Tensor, row_slots: Sequence[int], weights: Sequence[LoraWeights | None]
) -> torch.Tensor:
    """out[i] += scale * (x[i] @ A.T) @ B.T with row i's own slot's weights (slot -1 or None weights: nothing)."""
    for i, slot in enumerate(row_slots):
        w = weights[slot] if slot >= 0 else None
        if w is not None:
            out[i : i + 1].addmm_(x[i : i + 1] @ w.a.t(), w.b.t(), alpha=w.scale)
    return out


MAX_SIBLINGS = 3  # layers one launch of the Triton kernels serves (q/k/v)


@dataclass(frozen=True)
class SiblingLaunch:
    """What a launch of the Triton kernels (`bgmv.py`, `sgmv.py`) takes of up to three sibling outputs, column
    slices of one tensor: `base`, the index of the one that starts first (the others lie at `offsets` elements
    from it), and per sibling, padded to MAX_SIBLINGS, its layer's index in the tables, its width and its output
    blocks; the rank padded to a power of two; the input features split into `splits` spans of `per_split` for the
    shrink; `count`, the siblings before the padding."""

    base: int
    offsets: tuple[int, ...]
    layers: tuple[int, ...]
    widths: tuple[int, ...]
    blocks: tuple[int, ...]
    rank_p: int
    splits: int
    per_split: int
    count: int


def sibling_launch(outs: Sequence[torch.Tensor], x: torch.Tensor, tables: PointerTable, names: Sequence[str],
                   max_rank: int, units: int, block_n: int, block_k: int, target_programs: int) -> SiblingLaunch:
    """The launch of `names`' deltas into `outs` for the input x [T, in]; `units` (rows or tiles) each take their
    share of `target_programs` shrink programs, the input split to reach it. Called per layer per step: the
    plan is kept for the arguments' numbers, and only what the kernels' memory safety rests on is checked here."""
    assert 1 <= len(outs) == len(names) <= MAX_SIBLINGS
    rows, in_features = x.shape
    stride = outs[0].stride(0)
    assert x.stride(1) == 1 and all(o.stride(1) == 1 and o.stride(0) == stride and o.dtype == x.dtype
                                    and o.shape[0] == rows for o in outs)
    addresses = [o.data_ptr() for o in outs]
    first = min(addresses)
    size = x.element_size()
    offsets = tuple((a - first) // size for a in addresses)
    storage = outs[0].untyped_storage().data_ptr()  # touching allocations are not one tensor
    assert all(off + o.shape[1] <= stride and o.untyped_storage().data_ptr() == storage
               for off, o in zip(offsets, outs)), "the outputs must be column slices of one tensor"
    return _plan(addresses.index(first), offsets, tuple(tables.index[name] for name in names),
                 tuple(o.shape[1] for o in outs), in_features, max_rank, units, block_n, block_k, target_programs)


def sibling_launch_at(offsets: Sequence[int], widths: Sequence[int], x: torch.Tensor, tables: PointerTable,
                      names: Sequence[str], max_rank: int, units: int, block_n: int, block_k: int,
                      target_programs: int) -> SiblingLaunch:
    """`sibling_launch` for outputs that do not exist yet: the columns `offsets` (ascending) and `widths` of one
    [T, *] tensor the base product will fill (`bgmv.shrink_rows_at` plans its shrink before that product; `fits`
    checks the outputs it is then given)."""
    assert 1 <= len(offsets) == len(widths) == len(names) <= MAX_SIBLINGS and list(offsets) == sorted(offsets)
    assert x.stride(1) == 1
    first = offsets[0]
    return _plan(0, tuple(off - first for off in offsets), tuple(tables.index[name] for name in names),
                 tuple(widths), x.shape[1], max_rank, units, block_n, block_k, target_programs)


def fits(launch: SiblingLaunch, outs: Sequence[torch.Tensor]) -> bool:
    """Whether `outs` are the outputs `launch` was planned for (`sibling_launch_at`): the kernels write through
    its offsets from `outs[launch.base]`, so any other tensors would be written out of bounds."""
    if len(outs) != launch.count:
        return False
    first = outs[launch.base]
    size, stride, storage = first.element_size(), first.stride(0), first.untyped_storage().data_ptr()
    return all(o.dtype == first.dtype and o.untyped_storage().data_ptr() == storage and o.stride() == first.stride() and o.shape[0] == first.shape[0]
               and o.shape[1] == width and o.data_ptr() - first.data_ptr() == offset * size
               and offset + width <= stride for o, offset, width in zip(outs, launch.offsets, launch.widths))


@functools.lru_cache(maxsize=4096)
def _plan(base: int, offsets: tuple[int, ...], layers: tuple[int, ...], widths: tuple[int, ...], in_features: int,
          max_rank: int, units: int, block_n: int, block_k: int, target_programs: int) -> SiblingLaunch:
    pad = (0,) * (MAX_SIBLINGS - len(layers))
    splits = max(1, min(-(-target_programs // max(units, 1)), -(-in_features // block_k)))
    per_split = -(-in_features // splits // block_k) * block_k
    return SiblingLaunch(
        base, offsets + pad, layers + pad, widths + pad, tuple(-(-w // block_n) for w in widths) + pad,
        rank_p=max(16, 1 << (max_rank - 1).bit_length()), splits=-(-in_features // per_split), per_split=per_split,
        count=len(layers))
