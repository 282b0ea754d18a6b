"""The engine's adapters: which adapters the engine's requests use (with how many requests use each), their
installs into device slots at the start of a step, the staging of the next ones, and eviction.

The scheduler decides which adapter gets which slot (lora/device/residency.py); this module carries it out on the
device (lora/device/table.py). A failed install is returned as a decision ("fail these adapters' requests") for
the engine to act on: this module never touches requests' state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from loraplex.engine.requests.request import Request
from loraplex.engine.scheduling.scheduler import Scheduler
from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.device.table import AdapterTable

STAGE_LOOKAHEAD = 256  # waiting requests looked through for the adapters to stage next

log = logging.getLogger(__name__)


class EngineAdapters:
    def __init__(self, lora: AdapterTable, scheduler: Scheduler) -> None:
        self.lora = lora
        self.scheduler = scheduler
        # Adapters of the requests in the engine, with how many requests use each.
        self.in_use: dict[str, tuple[LoraAdapter, int]] = {}
        # Keys no new request will use (a name unloaded or replaced): evicted once no request uses them.
        self.retired: set[str] = set()

    def use(self, adapter: LoraAdapter) -> None:
        """One more request uses `adapter` (checked against the model already: engine/requests/inputs.py)."""
        _, users = self.in_use.get(adapter.key, (adapter, 0))
        self.in_use[adapter.key] = (adapter, users + 1)

    def drop(self, key: str | None) -> None:
        """One request fewer uses the adapter of store key `key` (None: the base model)."""
        if key is None:
            return
        adapter, users = self.in_use[key]
        if users == 1:
            del self.in_use[key]
        else:
            self.in_use[key] = (adapter, users - 1)

    def install(self, installs: Iterable[tuple[int, str]]) -> dict[str, str]:
        """Install the step's new adapters (slot, key) into their slots. Returns the adapters whose install raised,
        each with the message its requests fail with; their slots are left empty (a later request for one installs
        it again)."""
        broken: dict[str, str] = {}
        with self.lora.installs():
            for slot, key in installs:
                adapter = self.in_use[key][0]
                try:
                    self.lora.install(slot, adapter)
                except Exception as error:  # noqa: BLE001
                    log.error("installing adapter %r failed: %r", adapter.adapter_id, error)
                    self.lora.clear(slot)  # an install stopped half way must leave nothing behind
                    broken[key] = f"adapter {adapter.adapter_id!r} could not be installed: {error}"
        return broken

    def evict(self, key: str) -> None:
        """Take the adapter `key` out of its device slot now, if it has one; no request may be using it."""
        slots = self.scheduler.slots
        slot = slots.slot_of(key)
        if slot is not None:
            slots.evict(key)
            self.lora.clear(slot)

    def retire(self, key: str) -> None:
        """No new request will use the adapter `key`: free its slot once the requests that use it are gone."""
        self.scheduler.slots.unhold(key)
        self.retired.add(key)

    def free_retired(self) -> None:
        """Before a step is scheduled: the slots of retired adapters that no request uses any more are given back
        to the scheduler (their weights stay on the device until another adapter is installed there: a step in
        flight may still read them)."""
        for key in [key for key in self.retired if key not in self.in_use]:
            self.retired.discard(key)
            if self.scheduler.slots.slot_of(key) is not None:
                self.scheduler.slots.evict(key)

    def stage_next_installs(self) -> None:
        """Have the adapters that the waiting queue wants next, and no slot holds, laid out ahead of their
        installs (lora/device/staging.py); in queue order, as the scheduler admits. The queue is read only as far as the
        staging budget reaches (repeats are yielded; `stage_ahead` skips them). Nothing to do for a base-model
        queue with nothing staged."""
        if not ((self.in_use and self.scheduler.waiting) or self.lora.staged):
            return
        slots = self.scheduler.slots

        def wanted():
            for request in itertools.islice(self.scheduler.waiting, STAGE_LOOKAHEAD):
                key = request.adapter_key
                if key is not None and slots.slot_of(key) is None:
                    yield self.in_use[key][0]

        self.lora.stage_ahead(wanted())

    def adapter_ids(self) -> dict[str, list[str]]:
        """Distinct adapters of running and of waiting requests, by the adapters' ids (the clients' names)."""
        # Copies first: metrics read this from another thread while the engine thread runs.
        adapters = dict(self.in_use)

        def names(requests: list[Request]) -> list[str]:
            return sorted({adapters[r.adapter_key][0].adapter_id for r in requests if r.adapter_key in adapters})

        return {"running": names(list(self.scheduler.running)), "waiting": names(list(self.scheduler.waiting))}
