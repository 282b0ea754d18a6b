"""How cold adapters load beside the engine: a bounded number at a time in arrival order, on threads of lower CPU
priority, laid out in the engine's flat format (the slots' dtype) so that an install copies nothing more on the host.

The engine-level behaviour (other streams keep their pace while adapters load) is tests/engine/test_cold_adapters.py.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from loraplex.lora.device.staging import StagedUploads
from loraplex.lora.device.upload import AdapterUploader
from loraplex.lora.layout import FlatFormat
from loraplex.lora.sources.local_source import LocalSource
from loraplex.lora.sources.store import AdapterStore
from tests.lora.test_store import BASE, MAX_RANK, write_adapter


class GatedSource:
    """A local source whose `directory` waits for the test's gate: records who entered, and how many are inside."""

    def __init__(self, root, gate: threading.Event) -> None:
        self.local, self.gate = LocalSource([root]), gate
        self.entered: list[str] = []
        self.inside = self.most_inside = 0
        self.lock = threading.Lock()
        self.all_entered = threading.Condition(self.lock)

    def canonical_id(self, adapter_id: str) -> str:
        return self.local.canonical_id(adapter_id)

    @contextlib.contextmanager
    def directory(self, canonical_id: str):
        with self.lock:
            self.entered.append(canonical_id)
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.all_entered.notify_all()
        try:
            assert self.gate.wait(timeout=30), "the test never opened the gate"
            with self.local.directory(canonical_id) as path:
                yield path
        finally:
            with self.lock:
                self.inside -= 1


def test_loads_run_a_bounded_number_at_a_time_in_arrival_order(tmp_path):
    for k in range(5):
        write_adapter(tmp_path / f"a{k}", seed=k)
    gate = threading.Event()
    source = GatedSource(tmp_path, gate)
    store = AdapterStore(BASE, MAX_RANK, sources={"gated": source}, loader_threads=3)
    try:
        futures = [store._adapter_future(f"a{k}", "gated", None)[1] for k in range(5)]
        with source.lock:
            assert source.all_entered.wait_for(lambda: len(source.entered) == 3, timeout=30)
        assert source.entered == ["a0", "a1", "a2"]  # the first three to arrive; the others queue
        gate.set()
        adapters = [future.result(timeout=30) for future in futures]
        assert source.entered == [f"a{k}" for k in range(5)] and source.most_inside == 3
        assert [a.adapter_id for a in adapters] == [f"gated:a{k}" for k in range(5)]
    finally:
        gate.set()
        store.close()


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities are Linux's")
def test_loader_threads_run_at_a_lower_cpu_priority_than_the_engine(tmp_path):
    store = AdapterStore(BASE, MAX_RANK)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        theirs = store._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
        assert theirs > mine or mine == 19
        # and the engine's thread (this one) keeps its own
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        store.close()


def test_the_store_lays_adapters_out_in_the_engines_flat_format(tmp_path):
    write_adapter(tmp_path / "a", seed=3)
    as_float = AdapterStore(BASE, MAX_RANK, roots=[tmp_path], default_source="local")
    as_slots = AdapterStore(BASE, MAX_RANK, roots=[tmp_path], default_source="local",
                            flat_format=FlatFormat(torch.bfloat16))
    try:
        reference, adapter = as_float.load("a"), as_slots.load("a")
    finally:
        as_float.close()
        as_slots.close()
    assert reference.flat.dtype == torch.float32 and adapter.flat.dtype == torch.bfloat16
    for name, weights in reference.modules.items():
        assert torch.equal(adapter.modules[name].a, weights.a.to(torch.bfloat16))
        assert torch.equal(adapter.modules[name].b, weights.b.to(torch.bfloat16))
        assert adapter.modules[name].scale == weights.scale
    assert adapter.fingerprint != reference.fingerprint  # not the same computation: never the same cached KV


def test_a_store_load_hashes_no_weight_and_each_load_is_its_own_prefix_cache_identity(tmp_path):
    """A cold load's pass over every weight for a fingerprint is spared: the prefix cache keys a store load's blocks by
    the load's random token, so two loads of the same files (after an eviction) never share KV, and one load's
    requests do. The padding between modules is zero all the same (the content fingerprint, named adapters' key,
    hashes it)."""
    write_adapter(tmp_path / "a", seed=2)
    stores = [AdapterStore(BASE, MAX_RANK, roots=[tmp_path], default_source="local") for _ in range(2)]
    try:
        first, again, other = stores[0].load("a"), stores[0].load("a"), stores[1].load("a")
    finally:
        for store in stores:
            store.close()
    assert "fingerprint" not in first.__dict__  # never hashed by the load
    assert again is first and len(first.load_token) == 16 and first.cache_identity == first.load_token
    assert other.cache_identity != first.cache_identity  # another load of the same files
    assert other.fingerprint == first.fingerprint  # the same weights, padding included
    covered = torch.zeros(first.layout.length, dtype=torch.bool)
    for a_at, rank, n_in, b_at, n_out in first.layout.entries.values():
        covered[a_at:a_at + rank * n_in] = covered[b_at:b_at + rank * n_out] = True
    assert not covered.all() and torch.all(first.flat[~covered] == 0)  # padding there is, and it is zero


def test_an_adapter_in_the_slots_format_is_staged_without_a_copy(tmp_path):
    """A flat buffer already in the slots' dtype (pinned where copies to the device are asynchronous: the GPU suite
    checks that case) is what the slot reads or the copy to the device reads: no staging copy, nothing staged ahead."""
    write_adapter(tmp_path / "a", seed=1)
    store = AdapterStore(BASE, MAX_RANK, roots=[tmp_path], default_source="local",
                         flat_format=FlatFormat(torch.bfloat16))
    try:
        adapter = store.load("a")
    finally:
        store.close()
    uploader = AdapterUploader(torch.device("meta"), torch.bfloat16)  # a device of its own, without pinned memory
    assert uploader.takes_as_is(adapter.flat)
    assert uploader.stage(adapter.modules, adapter.flat, adapter.layout) is adapter.flat
    staged = StagedUploads(uploader)
    staged.want([adapter])
    assert staged.staged_keys == []
    # In another dtype it is staged as before; a CPU slot in the same dtype reads the adapter's buffer itself.
    assert not AdapterUploader(torch.device("meta"), torch.float16).takes_as_is(adapter.flat)
    on_cpu = AdapterUploader(torch.device("cpu"), torch.bfloat16)
    assert on_cpu.upload(adapter.modules, adapter.flat, adapter.layout).buffer is adapter.flat


def test_the_server_store_takes_the_load_threads_and_the_engines_format():
    from loraplex.config import ServerConfig
    from loraplex.engine.stats import AdapterTargets
    from loraplex.server.app import adapter_store

    targets = AdapterTargets(dict(BASE), MAX_RANK, base_weight=lambda m: None, checkpoint_name=None,
                             flat_format=FlatFormat(torch.bfloat16))
    store = adapter_store(targets, ServerConfig(adapter_load_threads=3))
    try:
        assert store._pool._max_workers == 3 and store.flat_format == FlatFormat(torch.bfloat16)
    finally:
        store.close()
    store = adapter_store(targets, ServerConfig())  # the default: half the cores, 2 to 8
    try:
        assert store._pool._max_workers == max(2, min(8, (os.cpu_count() or 2) // 2))
    finally:
        store.close()
