"""The stacked form's weights (the CPU's decode steps of several adapters), kept across steps.

Per layer the adapters of a step are stacked, A [G, R, in] and B [G, out, R] with the scale folded into B and ranks
zero-padded to R, and two batched matmuls serve every adapter's rows (lora/step/kernels/segments.py). Building the
stacks copies every adapter's weights once; rebuilt whenever a step's set of slots changed (a request joined or
finished on another adapter), they cost every such step the copy of them all, on the engine's thread, while other
requests wait. So the stacks are kept: each slot's adapter is written into a group of its own when it first joins a
stacked step (or after its slot's adapter changed), into a group no slot of that step uses; the stacks are rebuilt
only when a step needs a larger rank, a layer they lack, or more groups than they have, and then with room to grow.
Groups of slots that are not in a step compute on a placeholder row and are never read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from loraplex.lora.step.experts import ExpertProjection
from loraplex.lora.step.row_maps import LoraGroups, LoraSegment


@dataclass
class Stack:
    """Slots' adapters stacked: slot -> its group (of `num_groups`), and per layer (A, B) for the layers at least
    one of them targets."""

    group_of: dict[int, int]
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    num_groups: int
    rank: int

    def groups(self, segments: Sequence[LoraSegment], device: torch.device) -> LoraGroups:
        """How the rows of `segments` (contiguous, each of a slot in the stack) fill the stack's groups."""
        assert segments, "no rows use an adapter"
        start, end = segments[0].start, segments[-1].end
        per_group = [0] * self.num_groups
        for segment in segments:
            per_group[self.group_of[segment.slot]] += segment.end - segment.start
        rows_per_group = max(per_group)
        # Positions no row fills (short or empty groups) compute on row `start`; nothing reads them back.
        gather = [start] * (len(per_group) * rows_per_group)
        scatter: list[int] = []
        filled = [0] * len(per_group)
        previous_end = start
        for segment in segments:
            assert segment.start == previous_end, "adapter rows must be contiguous (the runner sorts them)"
            previous_end = segment.end
            group = self.group_of[segment.slot]
            for row in range(segment.start, segment.end):
                position = group * rows_per_group + filled[group]
                gather[position] = row
                scatter.append(position)
                filled[group] += 1
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return LoraGroups(start, end, len(per_group), rows_per_group, as_tensor(gather), as_tensor(scatter))


class SlotStacks:
    """One table's stacks, kept across steps (see the module's notes)."""

    def __init__(self, table: Any) -> None:  # its AdapterTable (table.py): columns, layers, device, dtype
        self.table = table
        self.stack: Stack | None = None
        self.stale: set[int] = set()  # slots whose adapter changed since their group was written

    def changed(self, slot: int) -> None:
        """The adapter in `slot` was installed or cleared: its group is written again when it is next stacked."""
        self.stale.add(slot)

    def for_slots(self, slots: tuple[int, ...]) -> Stack:
        """A stack holding the current adapters of `slots` (and maybe others')."""
        stack = self.stack
        if stack is not None and stack.num_groups <= 2 * len(slots) + 8 \
                and all(s in stack.group_of and s not in self.stale for s in slots):
            return stack  # the common case: every slot already written, nothing changed
        table = self.table
        rank = max((t[s].rank for t in table.columns.values() for s in slots if t[s] is not None), default=0)
        layers = {name for name, column in table.columns.items()
                  if not isinstance(table.layers[name], ExpertProjection) and any(column[s] is not None for s in slots)}
        if stack is None or rank > stack.rank or not layers <= stack.layers.keys() \
                or stack.num_groups > 2 * len(slots) + 8:  # too many groups to compute through: start afresh
            return self._build(slots, rank, layers)
        fresh = [s for s in slots if s not in stack.group_of or s in self.stale]
        if not fresh:
            return stack
        in_step = set(slots)
        taken = {stack.group_of[s] for s in slots if s in stack.group_of}
        free = [g for g in range(stack.num_groups) if g not in taken]
        unplaced = [s for s in fresh if s not in stack.group_of]
        if len(unplaced) > len(free):
            return self._build(slots, rank, layers, room=2 * len(slots))
        for slot, group in zip(unplaced, free):
            for other in [o for o, g in stack.group_of.items() if g == group and o not in in_step]:
                del stack.group_of[other]
            stack.group_of[slot] = group
        for slot in fresh:
            self._write(stack, slot, stack.group_of[slot])
        return stack

    def _build(self, slots: tuple[int, ...], rank: int, layers: set[str], room: int = 0) -> Stack:
        table = self.table
        num_groups = max(len(slots), room)
        stacks = {}
        for name in layers:
            layer = table.layers[name]
            stacks[name] = (torch.zeros(num_groups, rank, layer.in_features, device=table.device, dtype=table.dtype),
                            torch.zeros(num_groups, layer.out_features, rank, device=table.device, dtype=table.dtype))
        self.stack = Stack({slot: group for group, slot in enumerate(slots)}, stacks, num_groups, rank)
        for group, slot in enumerate(slots):
            self._write(self.stack, slot, group, zero=False)
        return self.stack

    def _write(self, stack: Stack, slot: int, group: int, zero: bool = True) -> None:
        """The adapter now in `slot` into `group` of every layer (zeros where it does not target the layer)."""
        for name, (a_stack, b_stack) in stack.layers.items():
            weights = self.table.columns[name][slot]
            if zero:
                a_stack[group].zero_()
                b_stack[group].zero_()
            if weights is not None:
                a_stack[group, : weights.rank] = weights.a
                b_stack[group, :, : weights.rank] = weights.b * weights.scale
        self.stale.discard(slot)
