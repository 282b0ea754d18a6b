"""Installs prepared ahead: the host half of the uploads of adapters that waiting requests will want next.

An install's host work is mostly laying the adapter out in the slots' dtype (a converting copy of its whole flat
buffer into pinned memory, `AdapterUploader.stage`); done in the step that installs it, it adds to that step's
time (with many more adapters than slots, a share of every prompt step; docs/benchmarks.md). `StagedUploads` does it
on a worker thread while earlier steps run (the copy releases the GIL), for the few adapters the waiting queue
will want next; the install then takes the staged buffer, and only the copy to the device (on the uploader's side
stream) and the slot tables remain. A staged buffer is kept for the very adapter object it was made from: one
reloaded under the same key is staged anew.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import torch

from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.device.upload import AdapterUploader

# Staged buffers hold pinned copies of the weights until their installs (or until no waiting request wants them):
# at most this many bytes of them, but always the next adapter's. Rank-16 adapters on all seven projections are
# ~10 MB at a 135M model's shape (25 staged) and ~84 MB at an 8B's (3). Where requests join a few at a time
# (engine/scheduling/joins.py) one step installs many adapters, and the decode steps before it leave the worker time to
# stage them all.
STAGING_BYTES = 256 * 2**20


class StagedUploads:
    def __init__(self, uploader: AdapterUploader, budget_bytes: int = STAGING_BYTES) -> None:
        self.uploader, self.budget_bytes = uploader, budget_bytes
        self._staged: dict[str, tuple[LoraAdapter, Future]] = {}
        # Started at the first adapter staged; its thread ends when this object is collected.
        self._worker: ThreadPoolExecutor | None = None

    def want(self, adapters: Iterable[LoraAdapter]) -> None:
        """Stage the first distinct adapters of `adapters` (in the order they will be installed) that fit the
        budget, the first one always; drop what was staged for any other. `adapters` is read no further than the
        budget reaches (the engine passes a walk over its waiting queue)."""
        wanted: dict[str, LoraAdapter] = {}
        left = self.budget_bytes
        for adapter in adapters:
            if adapter.key in wanted or not _stageable(adapter, self.uploader):
                continue
            size = adapter.layout.length * self.uploader.dtype.itemsize
            if wanted and size > left:
                break
            wanted[adapter.key] = adapter
            left -= size
        for key, (adapter, future) in list(self._staged.items()):
            if wanted.get(key) is not adapter:
                future.cancel()  # a copy already running finishes, and its buffer is dropped
                del self._staged[key]
        for key, adapter in wanted.items():
            if key not in self._staged:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="loraplex-staging")
                self._staged[key] = (adapter, self._worker.submit(
                    self.uploader.stage, adapter.modules, adapter.flat, adapter.layout))

    def take(self, adapter: LoraAdapter) -> torch.Tensor | None:
        """The staged buffer of `adapter` (waiting for its copy if still running), or None when none was staged.
        Raises what staging it raised."""
        entry = self._staged.pop(adapter.key, None)
        if entry is None or entry[0] is not adapter:
            return None
        return entry[1].result()

    @property
    def staged_keys(self) -> list[str]:
        return list(self._staged)


def _stageable(adapter: LoraAdapter, uploader: AdapterUploader) -> bool:
    """Only adapters laid out in one host buffer (as the store loads them): a hand-built adapter's tensors may live
    on the device, where another thread's copy would run on another stream. Nor those whose buffer the device copy
    takes as it is (the store laid them out in the slots' dtype, pinned): there is nothing to do ahead."""
    return adapter.flat is not None and adapter.flat.is_cpu and not uploader.takes_as_is(adapter.flat)
