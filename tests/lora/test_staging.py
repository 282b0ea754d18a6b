"""Installs prepared ahead (lora/device/staging.py): which adapters are staged, that an install takes the very buffer staged
for that adapter object, and that a step's installs reach the slot tables in one copy."""

import threading

import pytest
import torch

from loraplex.lora.adapter import LoraAdapter, LoraConfig
from loraplex.lora.step.kernels import PointerTable
from loraplex.lora.device.staging import StagedUploads
from loraplex.lora.device.upload import AdapterUploader
from loraplex.lora.layout import FlatFormat
from loraplex.params import SamplingParams
from tests.lora.test_upload import modules


def adapter(name: str, seed: int) -> LoraAdapter:
    return LoraAdapter(name, modules(seed), LoraConfig(r=16, lora_alpha=16)).packed()


class CountingUploader(AdapterUploader):
    """Records which adapters' buffers were laid out, and on which thread."""

    def __init__(self, *args, fail: str | None = None) -> None:
        super().__init__(*args)
        self.staged_on: list[tuple[int, str]] = []
        self.fail = fail

    def stage(self, modules, flat, layout):
        self.staged_on.append((threading.get_ident(), next(iter(modules.values())).a.flatten()[0].item()))
        if self.fail is not None:
            raise RuntimeError(self.fail)
        return super().stage(modules, flat, layout)


def test_the_first_distinct_adapters_are_staged_and_an_install_takes_their_buffer():
    uploader = CountingUploader(torch.device("cpu"), torch.bfloat16)
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    staging = StagedUploads(uploader, budget_bytes=2 * a.layout.length * 2)  # two adapters' bfloat16 copies
    staging.want([a, a, b, c])
    assert staging.staged_keys == ["a", "b"]
    buffer = staging.take(a)
    assert buffer.dtype == torch.bfloat16 and torch.equal(buffer, a.flat.to(torch.bfloat16))
    assert staging.take(a) is None  # taken once
    main = threading.get_ident()
    assert all(thread != main for thread, _ in uploader.staged_on)  # laid out on the worker thread
    staging.want([c])  # b is no longer wanted: dropped
    assert staging.staged_keys == ["c"] and staging.take(b) is None
    reloaded = adapter("c", 4)  # the same key, other weights: the buffer staged for the old object is not used
    assert staging.take(reloaded) is None


def test_the_next_adapter_is_staged_even_beyond_the_budget():
    staging = StagedUploads(CountingUploader(torch.device("cpu"), torch.bfloat16), budget_bytes=1)
    a, b = adapter("a", 1), adapter("b", 2)
    staging.want([a, b])
    assert staging.staged_keys == ["a"]


def test_the_wanted_adapters_are_read_only_as_far_as_the_budget_reaches():
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    staging = StagedUploads(CountingUploader(torch.device("cpu"), torch.bfloat16), budget_bytes=a.layout.length * 2)
    read = []

    def walk():  # as the engine walks its waiting queue
        for x in (a, b, c):
            read.append(x.key)
            yield x

    staging.want(walk())
    assert staging.staged_keys == ["a"] and read == ["a", "b"]  # b did not fit: c was never looked at


def test_a_failed_staging_raises_at_the_install_that_takes_it():
    staging = StagedUploads(CountingUploader(torch.device("cpu"), torch.bfloat16, fail="disk gone"))
    a = adapter("a", 1)
    staging.want([a])
    with pytest.raises(RuntimeError, match="disk gone"):
        staging.take(a)


def test_a_steps_installs_reach_the_device_tables_in_one_copy(monkeypatch):
    pointers = PointerTable(["m0", "m1", "m2"], 4, torch.device("cpu"))
    uploader = AdapterUploader(torch.device("cpu"), torch.float32)
    copies = []
    to_device = pointers._to_device

    def counted():
        copies.append(len(copies))
        to_device()

    monkeypatch.setattr(pointers, "_to_device", counted)
    with pointers.deferred():
        pass
    assert copies == []  # a step without installs copies nothing (every step enters the context)
    with pointers.deferred():
        pointers.set_slot_uploaded(0, uploader.upload(modules(1)))
        pointers.set_slot_uploaded(1, uploader.upload(modules(2, ranks=(4, 0, 1))))
        assert copies == []
    assert copies == [0]
    pointers.set_slot(2, {})
    assert copies == [0, 1]  # outside the context: at once


def test_the_engine_stages_the_waiting_queues_next_adapters_while_one_runs(make_engine, monkeypatch):
    """One slot, three adapters queued: while the first runs, the next ones are laid out ahead, on the worker
    thread; each is laid out once, and the tokens are those of installs made on the spot. (The adapters are kept in
    another dtype than the slots', as a hand-built one may be: one in the slots' dtype, as the store loads them, is
    read by its slot as it is, with nothing to lay out.)"""
    from benchmarks.adapters import AdapterSpec, random_adapter

    laid_out_on = []
    stage = AdapterUploader.stage

    def recording_stage(self, modules, flat, layout):
        laid_out_on.append(threading.get_ident())
        return stage(self, modules, flat, layout)

    monkeypatch.setattr(AdapterUploader, "stage", recording_stage)
    spec = AdapterSpec(rank=16, alpha=512.0, targets=("q_proj", "v_proj"))  # strong: they move greedy tokens

    def run(ahead: bool) -> tuple[list[list[int]], list[str]]:
        engine = make_engine(max_active_adapters=1, max_lora_rank=16)
        if not ahead:
            engine.lora.stage_ahead = lambda adapters: None
        adapters = [random_adapter(f"adapter-{k}", engine.lora.base_shapes, spec, 16, k).packed(FlatFormat(torch.float64))
                    for k in range(3)]
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        requests = [engine.add_request([5, 6, 7, 8], params, adapter=a) for a in adapters]
        engine.step()
        staged_while_the_first_runs = list(engine.lora.staged)
        while engine.has_unfinished:
            engine.step()
        return [r.output_ids for r in requests], staged_while_the_first_runs

    main = threading.get_ident()
    ahead_tokens, staged = run(ahead=True)
    assert staged == ["adapter-1", "adapter-2"]
    assert len(laid_out_on) == 3 and laid_out_on[0] == main and all(t != main for t in laid_out_on[1:])
    laid_out_on.clear()
    plain_tokens, _ = run(ahead=False)
    assert laid_out_on == [main] * 3
    assert ahead_tokens == plain_tokens
    assert len({tuple(t) for t in plain_tokens}) == 3  # each adapter's weights show in its tokens
