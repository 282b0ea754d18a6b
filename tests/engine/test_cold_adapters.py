"""Cold adapters never stall the server (issue 57), on the embedded model on the CPU.

Adapters come from a slow source (an `AdapterSource` whose fetch sleeps before lending the directory: a download)
and are rank 64 on all seven projections of every layer (~78 MB each in float32 at this model's shape). As the
server does (server/state.py), a request resolves its adapter with `await store.get(...)`, then streams through the
`AsyncEngine`. What is checked:

1. a base-model stream keeps its pace while 8 cold adapters load side by side: its largest gap between two tokens
   while they load stays within 2x the largest gap of the same stream alone (same engine, just before); the 8
   requests are then sent to the engine together and run beside the stream;
2. the requests on those cold adapters give exactly the tokens they give warm, and alone (greedy);
3. a cold adapter whose fetch fails (the source raises, or its file is corrupt) fails only its own requests;
4. more adapters in flight than device slots: cold loads, installs and evictions neither deadlock nor change
   anyone's tokens.

Synchronisation is by events and awaits only; the one sleep is the slow source's, which is what is under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import pathlib
import statistics
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterInvalid, AdapterNotFound
from loraplex.lora.sources.store import AdapterStore
from loraplex.params import SamplingParams
from loraplex.server.heap import freeze_start_up_heap

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 64, 16
STRENGTH = 0.3  # each module's delta is about this times the rms of its input: it changes the tokens
FETCH_S = 0.4  # the slow source's "download" of one adapter
COLD = tuple(f"cold-{i}" for i in range(8))
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
QUESTIONS = ("What is your name?", "Name a colour.")
BASELINE_TOKENS = 60  # the base stream alone
TIMEOUT_S = 180  # against a deadlock: far above what any of these runs takes


# ---- adapters and the slow source -------------------------------------------------------------------------------


def write_adapter(path: pathlib.Path, base_shapes, seed: int) -> pathlib.Path:
    """A PEFT adapter directory, as `save_pretrained` writes one: rank 64 on every projection of every layer, each
    module's B drawn so that its delta is about STRENGTH times the rms of its input (as tests/lora/peft_helpers.py)."""
    generator = torch.Generator().manual_seed(seed)
    scale = ALPHA / RANK
    tensors = {}
    for module, (fan_in, fan_out) in base_shapes.items():
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator) / math.sqrt(fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator) * (
                STRENGTH / (math.sqrt(RANK) * scale))
    assert len(tensors) == 2 * 7 * 30, "the embedded model has 30 layers of seven projections"
    path.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(PROJECTIONS),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config))
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    return path


class SlowSource:
    """An `AdapterSource` (lora/sources/source.py) whose fetch takes `delay_s`, as a remote store's download does.
    Adapters named in `unreachable` raise AdapterNotFound after the wait (the download failed)."""

    def __init__(self, root: pathlib.Path, delay_s: float = FETCH_S, unreachable: tuple[str, ...] = ()) -> None:
        self.root, self.delay_s, self.unreachable = root, delay_s, set(unreachable)
        self.fetched: list[str] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self.most_in_flight = 0  # fetches running at once, at most

    def canonical_id(self, adapter_id: str) -> str:
        return adapter_id  # cheap: it runs on the caller's thread (the event loop's)

    @contextlib.contextmanager
    def directory(self, canonical_id: str):
        with self._lock:
            self.fetched.append(canonical_id)
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
        try:
            time.sleep(self.delay_s)  # the download, on the store's loader thread
            if canonical_id in self.unreachable:
                raise AdapterNotFound(f"adapter {canonical_id!r}: the source could not fetch it")
            yield self.root / canonical_id
        finally:
            with self._lock:
                self._in_flight -= 1


def slow_store(base_shapes, source: SlowSource) -> AdapterStore:
    return AdapterStore(base_shapes, RANK, default_source="local", sources={"slow": source}, refusal_ttl_s=0.0)


# ---- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_shapes(embedded):
    return Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=256)).lora.base_shapes


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, base_shapes) -> pathlib.Path:
    """COLD, `warm-up` (an adapter for the engine's first LoRA step) and `corrupt` (its safetensors file cut half
    way, as by a failed download)."""
    root = tmp_path_factory.mktemp("slow-source")
    for i, name in enumerate(COLD):
        write_adapter(root / name, base_shapes, seed=100 + i)
    write_adapter(root / "warm-up", base_shapes, seed=99)
    weights = write_adapter(root / "corrupt", base_shapes, seed=98) / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return root


@pytest.fixture(scope="module")
def prompts(embedded) -> list[list[int]]:
    tok = embedded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def solo(embedded, base_shapes, adapter_root, prompts):
    """solo(adapter id or None for the base model, prompt index): that request's greedy tokens, run alone on an engine
    of its own with its adapter read straight from disk (computed once, when first asked for)."""
    store = AdapterStore(base_shapes, RANK, roots=[adapter_root], default_source="local")
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=1024, max_active_adapters=1))
    done: dict[tuple[str | None, int], list[int]] = {}

    def tokens(name: str | None, p: int) -> list[int]:
        if (name, p) not in done:
            adapter = store.load(name) if name is not None else None
            [out] = engine.generate([prompts[p]], PARAMS, adapters=[adapter])
            assert out.error is None, out.error
            done[name, p] = out.token_ids
        return done[name, p]

    yield tokens
    store.close()


@pytest.fixture
def make_async_engine(embedded):
    engines = []

    def make(**config) -> AsyncEngine:
        engines.append(AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096, **config))))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


async def run_request(async_engine: AsyncEngine, store: AdapterStore, prompt: list[int], adapter_id: str | None,
                      after: asyncio.Event | None = None, streaming: asyncio.Event | None = None) -> list[int]:
    """A request as the server runs it (server/state.py): its adapter resolved off the loop, then streamed. `after`:
    sent once that is set; `streaming`: set at its first token."""
    if after is not None:
        await after.wait()
    adapter = await store.get(adapter_id, source="slow") if adapter_id is not None else None
    tokens = []
    async for out in async_engine.generate(prompt, PARAMS, adapter=adapter):
        tokens.append(out.token.id)
        if streaming is not None:
            streaming.set()
    return tokens


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


# ---- 1 and 2: a base stream beside 8 cold adapters -----------------------------------------------------------


def cold_run(embedded, base_shapes, adapter_root, prompts, join_when_loaded: bool) -> dict:
    """One engine, one store: a request on a warm adapter (the engine's first LoRA step is not what is measured), a
    base stream alone (BASELINE_TOKENS), then the same stream while 8 requests resolve 8 cold adapters of the slow
    source at once and run, until they are done; then those 8 again, warm, all at once. `join_when_loaded`: each
    request is sent to the engine as soon as its adapter is loaded (as the server does); otherwise the 8 are sent
    together once all are loaded, so that the stream's gaps while they load show the loads alone."""
    source = SlowSource(adapter_root)
    store = slow_store(base_shapes, source)
    async_engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096,
                                                             max_active_adapters=len(COLD) + 1)))
    story = embedded.tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    freeze_start_up_heap()  # as `loraplex serve` does once started (server/heap.py): a load's garbage collections
    # then walk what the loads make, not the whole model (a pause of every stream, the loads' or not)

    async def main():
        await run_request(async_engine, store, prompts[0], "warm-up")
        alone = [time.perf_counter() async for _ in async_engine.generate(
            story, SamplingParams(max_new_tokens=BASELINE_TOKENS, ignore_eos=True))]

        beside: list[float] = []
        started, all_loaded, all_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        launched_at: list[float] = []
        loaded_at: dict[str, float] = {}
        done_at: dict[str, float] = {}

        async def base_stream():
            # Long enough for anything below; left (so aborted) two tokens after the cold requests are done.
            params = SamplingParams(max_new_tokens=2000, ignore_eos=True)
            async with contextlib.aclosing(async_engine.generate(story, params)) as stream:
                async for _ in stream:
                    beside.append(time.perf_counter())
                    if len(beside) == 5:
                        started.set()  # the stream is in its stride: the loads start now
                    if all_done.is_set() and sum(t > max(done_at.values()) for t in beside) >= 2:
                        break

        async def cold(name: str) -> list[int]:
            await started.wait()
            launched_at.append(time.perf_counter())
            adapter = await store.get(name, source="slow")
            loaded_at[name] = time.perf_counter()
            if len(loaded_at) == len(COLD):
                all_loaded.set()
            if not join_when_loaded:
                await all_loaded.wait()
            tokens = [out.token.id async for out in async_engine.generate(prompts[0], PARAMS, adapter=adapter)]
            done_at[name] = time.perf_counter()
            if len(done_at) == len(COLD):
                all_done.set()
            return tokens

        _, *cold_tokens = await asyncio.gather(base_stream(), *(cold(name) for name in COLD))
        warm_tokens = await asyncio.gather(*(run_request(async_engine, store, prompts[0], name) for name in COLD))
        return dict(alone=alone, beside=beside, start=min(launched_at), loaded=max(loaded_at.values()),
                    done=max(done_at.values()), cold=dict(zip(COLD, cold_tokens)), warm=dict(zip(COLD, warm_tokens)))

    try:
        run = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        async_engine.shutdown()
        store.close()
        gc.unfreeze()  # the rest of the test session collects as before
    assert sorted(source.fetched) == sorted([*COLD, "warm-up"]), "each adapter is fetched once"
    assert source.most_in_flight >= 2, "the cold adapters were fetched side by side"
    assert run["beside"][4] <= run["start"] and run["beside"][-1] > run["done"]
    return run


def gap_report(run: dict, window: list[float]) -> str:
    alone = gaps(run["alone"])
    return (f"alone ({len(alone)} gaps): largest {ms(max(alone))}, median {ms(statistics.median(alone))}; beside "
            f"({len(window)} gaps): largest {ms(max(window))}, median {ms(statistics.median(window))}, the largest "
            f"{[ms(g) for g in sorted(window)[-5:]]}; loads {run['loaded'] - run['start']:.2f} s, all done "
            f"{run['done'] - run['start']:.2f} s after the loads' start")


@pytest.fixture(scope="module")
def joined_when_loaded(embedded, base_shapes, adapter_root, prompts) -> dict:
    return cold_run(embedded, base_shapes, adapter_root, prompts, join_when_loaded=True)


@pytest.fixture(scope="module")
def loaded_then_joined(embedded, base_shapes, adapter_root, prompts) -> dict:
    return cold_run(embedded, base_shapes, adapter_root, prompts, join_when_loaded=False)


def test_a_base_stream_keeps_its_pace_while_cold_adapters_load(loaded_then_joined):
    """The loads alone (fetch, read, checks, layout, hash: on the store's threads; no request sent yet) leave the
    engine's steps alone: the stream's largest gap while they run is within 2x its largest gap alone."""
    run = loaded_then_joined
    # Its tokens from the loads' start to the first one after they are all done (the requests are sent then).
    first_after = next(t for t in run["beside"] if t > run["loaded"])
    window = gaps([t for t in run["beside"] if run["beside"][4] <= t <= first_after])
    alone = gaps(run["alone"])
    assert len(window) >= 10, gap_report(run, window)  # the loads took a while: a stall had the time to show
    # Within 2x but for at most 3 gaps: on 2 cores the loads' own CPU work (reading, converting and packing 8 x 78 MB
    # beside the steps) leaves an occasional gap of up to ~3x (two of 53 in one CI run); a stall of the engine shows in
    # a gap per adapter loaded (8 here), as the 1.1-1.4 s gaps this test found did.
    assert sorted(window)[-4] <= 2 * max(alone), gap_report(run, window)
    assert statistics.median(window) <= 2 * statistics.median(alone), gap_report(run, window)


@pytest.mark.parametrize("run", ["joined_when_loaded", "loaded_then_joined"])
def test_cold_adapters_give_their_warm_and_solo_tokens(request, run, solo):
    run = request.getfixturevalue(run)
    for name in COLD:
        assert run["cold"][name] == run["warm"][name] == solo(name, 0), name
    changed = [name for name in COLD if solo(name, 0) != solo(None, 0)]
    assert len(changed) >= len(COLD) // 2, f"the adapters must change the tokens for this to mean much: {changed}"


# ---- 3: a cold adapter that fails ---------------------------------------------------------------------------


@pytest.mark.parametrize("failing, error", [("unreachable", AdapterNotFound), ("corrupt", AdapterInvalid)])
def test_a_cold_adapter_that_fails_fails_only_its_own_requests(make_async_engine, base_shapes, adapter_root, solo,
                                                             prompts, failing, error):
    """`unreachable`: the source raises inside `directory()` (after its wait); `corrupt`: its safetensors file is cut
    half way. Base and other cold adapters' requests run beside both of its requests, all at once."""
    async_engine = make_async_engine(max_active_adapters=4)
    store = slow_store(base_shapes, SlowSource(adapter_root, unreachable=("unreachable",)))
    jobs = [(None, 0), (failing, 0), ("cold-0", 0), (None, 1), ("cold-1", 1), (failing, 1), ("cold-2", 0)]

    async def main():
        streaming = asyncio.Event()  # base requests join once a cold adapter's request runs
        return await asyncio.gather(
            *(run_request(async_engine, store, prompts[p], name, after=streaming if name is None else None,
                          streaming=streaming if name is not None else None) for name, p in jobs),
            return_exceptions=True)

    try:
        results = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        store.close()
    for (name, p), result in zip(jobs, results):
        if name == failing:
            assert isinstance(result, error), result
            assert repr(failing) in str(result)
        else:
            assert result == solo(name, p), (name, p, result)
    engine = async_engine.engine
    assert async_engine.alive and not engine.has_unfinished and engine.scheduler.allocator.num_used == 0


# ---- 4: more adapters than slots -----------------------------------------------------------------------------


def test_cold_loads_and_evictions_under_a_slot_limit(make_async_engine, base_shapes, adapter_root, solo, prompts):
    """2 device slots, 6 cold adapters (two with a second request) and base requests, all in flight at once: every
    adapter is installed (so slots are taken back and reused while cold loads go on), nothing deadlocks, and every
    request gives its solo tokens."""
    async_engine = make_async_engine(max_active_adapters=2)
    installs: list[tuple[int, str]] = []
    table = async_engine.engine.lora
    install = table.install

    def counted_install(slot, adapter):  # on the engine thread
        installs.append((slot, adapter.key))
        return install(slot, adapter)

    table.install = counted_install
    store = slow_store(base_shapes, SlowSource(adapter_root, delay_s=0.2))
    names = COLD[:6]
    jobs = [*((name, 0) for name in names), ("cold-1", 1), ("cold-4", 1), (None, 0), (None, 1), (None, 0)]

    async def main():
        streaming = asyncio.Event()  # base requests join once a cold adapter's request runs
        return await asyncio.gather(
            *(run_request(async_engine, store, prompts[p], name, after=streaming if name is None else None,
                          streaming=streaming if name is not None else None) for name, p in jobs))

    try:
        results = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        store.close()
    for (name, p), result in zip(jobs, results):
        assert result == solo(name, p), (name, p)
    assert {key for _, key in installs} >= {store.key(name, "slow") for name in names}
    assert {slot for slot, _ in installs} <= {0, 1}
    engine = async_engine.engine
    assert not engine.has_unfinished and engine.scheduler.allocator.num_used == 0
