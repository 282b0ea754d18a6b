"""The stacked form's weights kept across steps (lora/device/stacks.py): a slot's adapter is written into the stacks when
it joins a step, not every adapter again whenever the step's set of slots changes; whatever happened before, the
stack of a step holds exactly its slots' current adapters."""

from __future__ import annotations

import torch
from torch import nn

import loraplex.lora.device.stacks as stacks_module
from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.device.table import AdapterTable

SHAPES = {"0": (16, 24), "1": (24, 16)}


def adapter(seed: int, rank: int = 4, layers=("0", "1")) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    modules = {name: LoraWeights(torch.randn(rank, SHAPES[name][0], generator=g),
                                 torch.randn(SHAPES[name][1], rank, generator=g), 0.5 + seed)
               for name in layers}
    return LoraAdapter(f"a{seed}", modules, LoraConfig(r=rank, lora_alpha=rank)).packed()


def table(num_slots: int = 6) -> AdapterTable:
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16))
    return AdapterTable(model, num_slots, torch.device("cpu"), torch.float32, max_rank=16)


def assert_holds(slots: AdapterTable, step: tuple[int, ...]) -> None:
    """The step's stack holds each of its slots' current adapters in the slot's group (zero-padded), nothing else."""
    stack = slots.stack(step)
    for slot in step:
        group = stack.group_of[slot]
        for name, (a_stack, b_stack) in stack.layers.items():
            weights = slots.columns[name][slot]
            want_a = torch.zeros_like(a_stack[group])
            want_b = torch.zeros_like(b_stack[group])
            if weights is not None:
                want_a[: weights.rank] = weights.a
                want_b[:, : weights.rank] = weights.b * weights.scale
            assert torch.equal(a_stack[group], want_a) and torch.equal(b_stack[group], want_b), (slot, name)
    assert len({stack.group_of[s] for s in step}) == len(step)  # one group each


class Writes:
    """Counts the stacks' builds and the slots written into existing stacks."""

    def __init__(self, monkeypatch) -> None:
        self.builds, self.written = 0, []
        build, write = stacks_module.SlotStacks._build, stacks_module.SlotStacks._write

        def counted_build(stacks, *args, **kwargs):
            self.builds += 1
            return build(stacks, *args, **kwargs)

        def counted_write(stacks, stack, slot, group, zero=True):
            if zero:  # (a build's own writes pass zero=False)
                self.written.append(slot)
            return write(stacks, stack, slot, group, zero)

        monkeypatch.setattr(stacks_module.SlotStacks, "_build", counted_build)
        monkeypatch.setattr(stacks_module.SlotStacks, "_write", counted_write)


def test_a_slot_joining_a_step_is_written_alone_and_a_reinstalled_slot_again(monkeypatch):
    slots = table()
    for slot in range(4):
        slots.install(slot, adapter(slot))
    writes = Writes(monkeypatch)
    assert_holds(slots, (0, 1))
    assert writes.builds == 1
    assert_holds(slots, (0, 1, 2))  # a request of a third adapter joined: only it is written
    assert_holds(slots, (1, 2))  # one finished: nothing to write
    assert_holds(slots, (1, 2, 3))
    assert writes.builds == 2 and writes.written == [3]  # (the 3-slot step outgrew the first stack: built with room)
    slots.install(1, adapter(11))  # another adapter in slot 1: written again when it is next stacked
    assert_holds(slots, (0, 1, 2))
    assert writes.builds == 2 and sorted(writes.written) == [0, 1, 3]


def test_a_larger_rank_or_a_layer_the_stacks_lack_builds_them_again(monkeypatch):
    slots = table()
    slots.install(0, adapter(0, layers=("0",)))
    slots.install(1, adapter(1, layers=("0",)))
    slots.install(2, adapter(2, layers=("1",)))
    slots.install(3, adapter(3, rank=8))
    writes = Writes(monkeypatch)
    assert_holds(slots, (0, 1))
    assert_holds(slots, (0, 1, 2))  # layer "1" was not stacked
    assert_holds(slots, (0, 2, 3))  # rank 8 > 4
    assert writes.builds == 3
    assert_holds(slots, (0, 1, 2))  # cleared slots and smaller ranks fit the rank-8 stacks
    slots.clear(1)
    assert_holds(slots, (0, 1, 3))


def test_stacked_steps_give_the_rows_of_a_fresh_stack_whatever_came_before():
    """The delta of every row, through the kept stacks, equals the segment form's (each adapter's own matmuls)."""
    from loraplex.lora.step.kernels import add_lora, add_lora_stacked
    from loraplex.lora.step.row_maps import LoraSegment

    slots = table()
    for slot in range(5):
        slots.install(slot, adapter(slot, rank=2 + slot))
    for step in [(0, 1), (0, 1, 2, 3), (2, 3), (1, 3, 4), (0, 4)]:
        segments = [LoraSegment(slot, 2 * i, 2 * i + 2) for i, slot in enumerate(step)]
        x = torch.randn(2 * len(step), 16)
        out = torch.randn(2 * len(step), 24)
        stack = slots.stack(step)
        got = add_lora_stacked(out.clone(), x, stack.groups(segments, torch.device("cpu")), *stack.layers["0"])
        want = add_lora(out.clone(), x, segments, slots.columns["0"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
