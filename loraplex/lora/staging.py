"""Installs prepared ahead: the host half of the uploads of adapters that waiting requests will want next.

An install's host work is mostly laying the adapter out in the slots' dtype (a converting copy of its whole flat
buffer into pinned memory, `AdapterUploader.stage`); done in the step that installs it, it adds to that step's
time (with 1,000 adapters over 128 slots, ~4.6 ms of each prompt step on the H200's host). `StagedUploads` does it
on a worker thread while earlier steps run (the copy releases the GIL), for the few adapters the waiting queue
will want next; the install then takes the staged buffer, and only the copy to the device (on the uploader's side
stream) and the slot tables remain. A staged buffer is kept for the very adapter object it was made from: one
reloaded under the same key is staged anew.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.upload import AdapterUploader

# Adapters staged at once: each holds a pinned copy of its weights (~10 MB for a rank-16 adapter on all of a
# 135M model's projections, ~80 MB on an 8B's) until its install or until no waiting request wants it.
STAGED_ADAPTERS = 4


class StagedUploads:
    def __init__(self, uploader: AdapterUploader, limit: int = STAGED_ADAPTERS) -> None:
        self.uploader, self.limit = uploader, limit
        self._staged: dict[str, tuple[LoraAdapter, Future]] = {}
        # Started at the first adapter staged; its thread ends when this object is collected.
        self._worker: ThreadPoolExecutor | None = None

    def want(self, adapters: Sequence[LoraAdapter]) -> None:
        """Stage the first `limit` distinct adapters of `adapters` (in the order they will be installed); drop what
        was staged for any other."""
        wanted: dict[str, LoraAdapter] = {}
        for adapter in adapters:
            if len(wanted) == self.limit:
                break
            if _stageable(adapter):
                wanted.setdefault(adapter.key, adapter)
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


def _stageable(adapter: LoraAdapter) -> bool:
    """Only adapters laid out in one host buffer (as the store loads them): a hand-built adapter's tensors may live
    on the device, where another thread's copy would run on another stream."""
    return adapter.flat is not None and adapter.flat.is_cpu
