"""Adapter installs while a step is in flight (engine/worker/overlap.py installs the next step's adapters then): the host
never waits for the device, the copy runs on the uploader's side stream, and the next step on the main stream
reads the new weights, however long the copy takes (lora/device/upload.py, `PointerTable.set_slot`). CUDA only."""

import pytest
import torch
from torch import nn

from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights
from loraplex.lora.layout import FlatFormat
from loraplex.lora.step.kernels import add_lora_rows_reference
from loraplex.lora.device.table import AdapterTable

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

from loraplex.lora.step.kernels.bgmv import add_lora_rows  # noqa: E402  (Triton: CUDA only)

DEVICE = torch.device("cuda")
SPIN_CYCLES = 2_000_000_000  # about a second of one spinning kernel: far longer than installing three small adapters


def adapter(seed: int, rank: int = 8) -> LoraAdapter:
    """On the host; even seeds packed into one buffer, as the adapter store hands them to the engine, odd ones as
    tensors of their own, as built by hand."""
    g = torch.Generator().manual_seed(seed)
    modules = {name: LoraWeights(torch.randn(rank, n_in, generator=g), torch.randn(n_out, rank, generator=g), 0.5)
               for name, (n_in, n_out) in {"0": (256, 512), "1": (512, 256)}.items()}
    built = LoraAdapter(f"a{seed}", modules, LoraConfig(r=rank, lora_alpha=rank))
    return built.packed() if seed % 2 == 0 else built


def slots_with(adapters: list[LoraAdapter]) -> AdapterTable:
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256)).to(DEVICE)
    slots = AdapterTable(model, num_slots=len(adapters), device=DEVICE, dtype=torch.float32, max_rank=16)
    for slot, a in enumerate(adapters):  # the first installs allocate the pools the later ones reuse
        slots.install(slot, a)
    torch.cuda.synchronize()
    return slots


def busy(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Keep `stream` busy, as a step in flight keeps the main stream; the event marks the end of the work."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN_CYCLES)
        done = torch.cuda.Event()
        done.record()
    return done


def assert_rows_read(slots: AdapterTable, adapters: list[LoraAdapter]) -> None:
    """A step's LoRA rows, launched now on the main stream, add the deltas of `adapters` (slot by slot)."""
    row_slots = [0, 1, 2, 1, 0]
    x = torch.randn(len(row_slots), 256, device=DEVICE)
    base = torch.randn(len(row_slots), 512, device=DEVICE)
    got = add_lora_rows(base.clone(), x, torch.tensor(row_slots, device=DEVICE), slots.pointers, "0", max_rank=16)
    expected = add_lora_rows_reference(base.clone(), x, row_slots, [a.modules["0"].to(DEVICE, torch.float32) for a in adapters])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.equal(got, base), "the adapters must change the rows"
    for slot, a in enumerate(adapters):  # the segment forms' views of each slot: the same weights
        torch.testing.assert_close(slots.columns["1"][slot].b, a.modules["1"].b.to(DEVICE), rtol=0, atol=0)


def test_installs_while_a_step_is_in_flight_leave_the_host_free_and_the_next_step_reads_them():
    slots = slots_with([adapter(0), adapter(1), adapter(2)])
    replacements = [adapter(10), adapter(11, rank=16), adapter(12, rank=4)]
    in_flight = busy(torch.cuda.current_stream())
    for slot, a in enumerate(replacements):
        slots.install(slot, a)
    assert not in_flight.query(), "an install made the host wait for the step in flight"
    assert_rows_read(slots, replacements)


def test_the_next_step_waits_for_a_slow_copy():
    slots = slots_with([adapter(0), adapter(1), adapter(2)])
    replacements = [adapter(20), adapter(21), adapter(22, rank=16)]
    copying = busy(slots._uploader.stream)  # a copy that takes a second: the main stream must wait for it
    for slot, a in enumerate(replacements):
        slots.install(slot, a)
    assert not copying.query(), "an install made the host wait for its copy"
    assert_rows_read(slots, replacements)


def test_an_adapter_the_store_laid_out_pinned_is_copied_from_its_own_buffer_before_the_step_reads_it():
    """The store lays adapters out for a GPU engine in the slots' dtype, in pinned memory (lora/layout.py
    FlatFormat): the install copies that very buffer on the side stream, nothing on the host, and the next step
    reads exactly what a synchronous upload of the same adapter gives, however long the copy takes."""
    form = FlatFormat(torch.bfloat16, pinned=True)
    host = [adapter(30 + 2 * k).packed(form) for k in range(3)]  # as the store's loads pack them (even seeds: packed)
    assert all(a.flat.is_pinned() and a.flat.dtype == torch.bfloat16 for a in host)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256)).to(DEVICE)
    slots = AdapterTable(model, num_slots=3, device=DEVICE, dtype=torch.bfloat16, max_rank=16)
    staged = []
    stage = slots._uploader.stage
    slots._uploader.stage = lambda modules, flat, layout: staged.append(stage(modules, flat, layout)) or staged[-1]
    copying = busy(slots._uploader.stream)
    for slot, a in enumerate(host):
        slots.install(slot, a)
    assert not copying.query(), "an install made the host wait for its copy"
    assert [s.data_ptr() for s in staged] == [a.flat.data_ptr() for a in host], "the install copied on the host"
    torch.cuda.synchronize()
    for slot, a in enumerate(host):
        for name in ("0", "1"):
            synchronous = a.modules[name].to(DEVICE, torch.bfloat16)
            assert torch.equal(slots.columns[name][slot].a, synchronous.a)
            assert torch.equal(slots.columns[name][slot].b, synchronous.b)
