"""Adapter residency: which adapter holds which device slot, and who may have one next. Pure Python.

- An adapter in a slot is pinned while any running request uses it; only unpinned slots are reused,
  least recently used first.
- Fair rotation (LoRAX's adapter cycle): when some waiting adapter has no slot and none can be had,
  adapters that have held their slot for longer than `cycle_time_s` stop admitting new requests.
  Their running requests finish, the slot unpins, and the adapter that has waited longest takes it.
  So no adapter waits forever, however busy the others are.
- A held adapter (a run-time load with `pinned`) keeps its slot once it has one: it is never evicted for another
  and never drains. At most num_slots - 1 adapters are held, so the others still rotate through one slot.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable


class AdapterResidency:
    def __init__(self, num_slots: int, cycle_time_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self.cycle_time_s = cycle_time_s
        self.clock = clock
        self.occupant: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._since: dict[str, float] = {}  # when the adapter got its slot
        self._recency: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._draining: set[str] = set()
        self._wanted: set[str] = set()  # adapters of this step's waiting requests
        self._held: set[str] = set()  # adapters that keep their slot (`hold`)

    def slot_of(self, adapter: str) -> int | None:
        return self._slot_of.get(adapter)

    def pins(self, adapter: str) -> int:
        return self._pins.get(adapter, 0)

    @property
    def active(self) -> list[str]:
        return [a for a in self.occupant if a is not None]

    def hold(self, adapter: str) -> bool:
        """Keep `adapter`'s slot, once it has one, until `unhold`; False (nothing held) when num_slots - 1 adapters
        are held already."""
        if adapter not in self._held and len(self._held) >= self.num_slots - 1:
            return False
        self._held.add(adapter)
        return True

    def unhold(self, adapter: str) -> None:
        self._held.discard(adapter)

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    # ---- each step ---------------------------------------------------------------------------------

    def begin_step(self, wanted: list[str]) -> None:
        """Decide which adapters stop admitting this step. `wanted`: adapters of waiting requests."""
        self._wanted = set(wanted)
        starved = any(a not in self._slot_of for a in wanted)
        if not starved or self._can_take_slot():
            self._draining = set()
            return
        now = self.clock()
        self._draining = {a for a, since in self._since.items() if now - since >= self.cycle_time_s and a not in self._held}

    def may_admit(self, adapter: str) -> bool:
        """Whether a waiting request for `adapter` may start now (its adapter is not draining)."""
        return adapter not in self._draining

    def acquire(self, adapter: str) -> tuple[int, bool] | None:
        """Pin a slot for one running request of `adapter`: (slot, must install) or None when none is free.

        Call only when `may_admit(adapter)`.
        """
        slot = self._slot_of.get(adapter)
        install = False
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            self._assign(slot, adapter)
            install = True
        self._pins[adapter] = self._pins.get(adapter, 0) + 1
        self._recency.move_to_end(adapter)
        return slot, install

    def release(self, adapter: str) -> None:
        """One running request of `adapter` stopped (finished, aborted or preempted)."""
        count = self._pins.get(adapter, 0)
        assert count > 0, f"adapter {adapter} released more often than acquired"
        if count == 1:
            del self._pins[adapter]
        else:
            self._pins[adapter] = count - 1

    def evict(self, adapter: str) -> None:
        """Take `adapter` out of its slot now, leaving the slot free (its install failed: the slot holds nothing
        usable). No running request may use it."""
        assert adapter not in self._pins, f"adapter {adapter} is evicted while running requests use it"
        self._held.discard(adapter)
        slot = self._slot_of.pop(adapter)
        del self._since[adapter], self._recency[adapter]
        self._draining.discard(adapter)
        self.occupant[slot] = None

    # ---- helpers -----------------------------------------------------------------------------------

    def _can_take_slot(self) -> bool:
        return None in self.occupant or any(a not in self._pins and a not in self._held for a in self._slot_of)

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned one (evicting its adapter)."""
        if None in self.occupant:
            return self.occupant.index(None)
        # Draining adapters go first (rotation is making room for others), then adapters no waiting
        # request wants (evicting a wanted one would only reinstall it elsewhere), then the LRU one.
        candidates = [a for a in self._recency if a not in self._pins and a not in self._held]
        if not candidates:
            return None
        victim = next(
            (a for a in candidates if a in self._draining),
            next((a for a in candidates if a not in self._wanted), candidates[0]),
        )
        slot = self._slot_of[victim]
        self.evict(victim)
        return slot

    def _assign(self, slot: int, adapter: str) -> None:
        self.occupant[slot] = adapter
        self._slot_of[adapter] = slot
        self._since[adapter] = self.clock()
        self._recency[adapter] = None
