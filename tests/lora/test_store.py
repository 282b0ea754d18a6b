"""AdapterStore: where adapters may come from (local roots, the HF cache), what is refused and how, and
the CPU cache (LRU, pinned preloads, one shared load per adapter, refusals remembered for a while).

No model: a fake base of four small linears, and adapter directories written here, as PEFT writes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import pickle
import threading

import pytest
import torch
from safetensors.torch import save_file

import loraplex.lora.sources.store as store_module
from loraplex.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, AdapterInvalid, AdapterNotFound
from loraplex.lora.sources.store import AdapterStore, MergeSpec

P = "base_model.model."
BASE = {
    "model.layers.0.self_attn.q_proj": (16, 16),
    "model.layers.0.self_attn.v_proj": (16, 8),
    "model.layers.1.self_attn.q_proj": (16, 16),
    "model.layers.1.self_attn.v_proj": (16, 8),
}
MAX_RANK = 8


def lora_tensors(r: int = 4, targets=("q_proj", "v_proj"), seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in BASE.items():
        if module.rsplit(".", 1)[1] in targets:
            tensors[f"{P}{module}.lora_A.weight"] = torch.randn(r, fan_in, generator=g)
            tensors[f"{P}{module}.lora_B.weight"] = torch.randn(fan_out, r, generator=g)
    return tensors


def write_adapter(path: pathlib.Path, r: int = 4, config: dict | None = None, tensors=None, seed: int = 0) -> pathlib.Path:
    """A PEFT adapter directory: adapter_config.json (+ `config` overrides) and adapter_model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    raw = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (path / ADAPTER_CONFIG).write_text(json.dumps({**raw, **(config or {})}))
    save_file(lora_tensors(r, seed=seed) if tensors is None else tensors, str(path / ADAPTER_WEIGHTS))
    return path


@pytest.fixture
def root(tmp_path) -> pathlib.Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path) -> pathlib.Path:
    """A valid adapter outside every root."""
    return write_adapter(tmp_path / "outside" / "a")


def make_store(*roots, default_source: str = "local", **kw) -> AdapterStore:
    store = AdapterStore(BASE, MAX_RANK, roots=roots, default_source=default_source, **kw)
    return store


@pytest.fixture
def store(root):
    s = make_store(root, refusal_ttl_s=0.0)  # tests rewrite files in place: no remembered refusals
    yield s
    s.close()


def refused(store: AdapterStore, adapter_id: str, kind=AdapterInvalid, source: str | None = None) -> str:
    with pytest.raises(kind) as info:
        store.load(adapter_id, source)
    return str(info.value)


class CountingLoads:
    """Stands in for `load_adapter_dir` in the store: counts reads; optionally each waits on `gate`."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.real, self.gate, self.calls = store_module.load_adapter_dir, gate, []

    def __call__(self, path, adapter_id, *args, **kw):
        self.calls.append(adapter_id)
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "the test never opened the gate"
        return self.real(path, adapter_id, *args, **kw)


@pytest.fixture
def loads(monkeypatch) -> CountingLoads:
    counter = CountingLoads()
    monkeypatch.setattr(store_module, "load_adapter_dir", counter)
    return counter


# ---- local source: what resolves inside the roots loads --------------------------------------------


def test_relative_id_under_a_root_loads_the_saved_weights(store, root):
    tensors = lora_tensors(r=4, seed=3)
    write_adapter(root / "a", r=4, config={"lora_alpha": 16}, tensors=tensors)
    adapter = store.load("a")
    assert adapter.adapter_id == "a"
    assert set(adapter.modules) == set(BASE)
    q0 = adapter.modules["model.layers.0.self_attn.q_proj"]
    assert torch.equal(q0.a, tensors[f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q0.b, tensors[f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"])
    assert q0.scale == 16 / 4
    assert store.loaded_ids() == ["a"]


def test_nested_relative_id_and_second_root(tmp_path, root):
    second = tmp_path / "second"
    write_adapter(second / "team" / "b")
    store = make_store(root, second)
    try:
        assert set(store.load("team/b").modules) == set(BASE)
    finally:
        store.close()


def test_absolute_path_inside_a_root_loads(store, root):
    path = write_adapter(root / "a")
    assert set(store.load(str(path)).modules) == set(BASE)


def test_symlink_inside_a_root_pointing_inside_loads(store, root):
    write_adapter(root / "real")
    (root / "alias").symlink_to(root / "real", target_is_directory=True)
    assert set(store.load("alias").modules) == set(BASE)


def test_a_root_given_through_a_symlink_is_the_directory_it_points_to(tmp_path):
    real = tmp_path / "real-root"
    write_adapter(real / "a")
    (tmp_path / "link-root").symlink_to(real, target_is_directory=True)
    store = make_store(tmp_path / "link-root")
    try:
        assert set(store.load("a").modules) == set(BASE)
        assert set(store.load(str(tmp_path / "link-root" / "a")).modules) == set(BASE)
    finally:
        store.close()


# ---- local source: what escapes the roots is refused -------------------------------------------------


def test_dotdot_escape_is_refused(store, outside, loads):
    message = refused(store, "../outside/a")
    assert "outside the adapter roots" in message and "../outside/a" in message
    assert loads.calls == []  # refused before anything is read


def test_absolute_path_outside_the_roots_is_refused(store, outside, loads):
    assert "outside the adapter roots" in refused(store, str(outside))
    assert loads.calls == []


def test_sibling_directory_sharing_the_roots_name_prefix_is_outside(tmp_path, root):
    evil = write_adapter(tmp_path / "root-evil" / "a")  # "/.../root-evil" starts with the string "/.../root"
    store = make_store(root)
    try:
        assert "outside the adapter roots" in refused(store, str(evil))
        assert "outside the adapter roots" in refused(store, "../root-evil/a")
    finally:
        store.close()


def test_symlink_inside_a_root_pointing_outside_is_refused(store, root, outside, loads):
    (root / "escape").symlink_to(outside, target_is_directory=True)
    assert "outside the adapter roots" in refused(store, "escape")
    assert "outside the adapter roots" in refused(store, str(root / "escape"))
    assert loads.calls == []


def test_no_roots_means_local_adapters_are_off(outside):
    store = make_store()
    try:
        message = refused(store, str(outside), AdapterNotFound)
        assert "local adapters are off" in message and "--adapter-root" in message
        assert "local adapters are off" in refused(store, "a", AdapterNotFound)
    finally:
        store.close()


def test_missing_directory_is_not_found(store):
    message = refused(store, "nope", AdapterNotFound)
    assert "'nope'" in message and "not found" in message


def test_directory_without_a_config_is_not_found(store, root):
    (root / "empty").mkdir()
    assert ADAPTER_CONFIG in refused(store, "empty", AdapterNotFound)


@pytest.mark.parametrize("adapter_id", ["bad\x00id", "x" * 300, "~no-such-user-loraplex/a"], ids=["nul", "long", "tilde"])
def test_ids_that_cannot_name_a_directory_are_refused_as_adapter_errors(store, adapter_id):
    # A client can send any string; each must come back as a refusal (404/422), never another exception (500).
    with pytest.raises(AdapterError):
        store.load(adapter_id)


def test_unknown_source_is_invalid(store, root):
    write_adapter(root / "a")
    assert "adapter_source 'gcs'" in refused(store, "a", source="gcs")


# ---- what is found but not served --------------------------------------------------------------------


def test_bin_only_adapter_is_refused_without_unpickling(store, root, tmp_path, monkeypatch):
    marker = tmp_path / "unpickled"

    class Bomb:  # unpickling this creates `marker`
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    path = root / "pickled"
    path.mkdir()
    (path / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    (path / "adapter_model.bin").write_bytes(pickle.dumps(Bomb()))

    def forbidden(*args, **kwargs):
        raise AssertionError("an adapter pickle was opened")

    for owner, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(owner, name, forbidden)
    message = refused(store, "pickled")
    assert "adapter_model.bin" in message and "pickle" in message and ADAPTER_WEIGHTS in message
    assert not marker.exists()


def test_corrupt_safetensors_is_invalid(store, root):
    path = write_adapter(root / "garbage")
    (path / ADAPTER_WEIGHTS).write_bytes(b"\x00\x01 this is not a safetensors file")
    assert "not a valid safetensors file" in refused(store, "garbage")

    path = write_adapter(root / "truncated")
    data = (path / ADAPTER_WEIGHTS).read_bytes()
    (path / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    assert "not a valid safetensors file" in refused(store, "truncated")


def test_config_that_is_not_json_is_invalid(store, root):
    path = write_adapter(root / "a")
    (path / ADAPTER_CONFIG).write_text("{not json")
    message = refused(store, "a")
    assert ADAPTER_CONFIG in message and "not valid JSON" in message

    (path / ADAPTER_CONFIG).write_text("[1, 2]")
    assert "not a JSON object" in refused(store, "a")


def test_rank_above_max_rank_is_invalid(store, root):
    write_adapter(root / "big", r=16)
    message = refused(store, "big")
    assert "r = 16" in message and f"maximum LoRA rank {MAX_RANK}" in message


def test_rank_pattern_above_max_rank_is_invalid(store, root):
    write_adapter(root / "big", r=4, config={"rank_pattern": {"q_proj": 16}})
    message = refused(store, "big")
    assert "rank_pattern['q_proj'] = 16" in message and f"maximum LoRA rank {MAX_RANK}" in message


@pytest.mark.parametrize("part", ["A", "B"])
def test_wrong_tensor_shape_names_the_tensor(store, root, part):
    tensors = lora_tensors(r=4)
    name = f"{P}model.layers.1.self_attn.v_proj.lora_{part}.weight"
    tensors[name] = torch.randn(4, 15) if part == "A" else torch.randn(9, 4)
    write_adapter(root / "a", r=4, tensors=tensors)
    message = refused(store, "a")
    assert name in message
    assert ("expected [4, 16]" if part == "A" else "expected [8, 4]") in message


def test_tensor_shapes_must_match_the_configured_rank(store, root):
    write_adapter(root / "a", r=2, tensors=lora_tensors(r=4))  # config says 2, tensors are rank 4
    message = refused(store, "a")
    assert "lora_A.weight has shape [4, 16]" in message and "rank 2" in message


def test_dora_config_is_invalid(store, root):
    write_adapter(root / "dora", config={"use_dora": True})
    message = refused(store, "dora")
    assert "DoRA" in message and "use_dora" in message


def test_dora_magnitude_tensor_is_invalid(store, root):
    tensors = lora_tensors()
    name = f"{P}model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    tensors[name] = torch.ones(16)
    write_adapter(root / "dora", tensors=tensors)
    message = refused(store, "dora")
    assert name in message and "DoRA" in message


def test_modules_to_save_is_invalid(store, root):
    write_adapter(root / "a", config={"modules_to_save": ["lm_head"]})
    assert "modules_to_save" in refused(store, "a")


def test_bias_all_is_invalid(store, root):
    write_adapter(root / "a", config={"bias": "all"})
    assert "bias='all'" in refused(store, "a")


def test_non_lora_peft_type_is_invalid(store, root):
    write_adapter(root / "a", config={"peft_type": "PREFIX_TUNING"})
    message = refused(store, "a")
    assert "peft_type 'PREFIX_TUNING'" in message and "only LORA" in message


def test_lora_on_embeddings_is_invalid(store, root):
    tensors = lora_tensors()
    tensors[f"{P}model.embed_tokens.lora_embedding_A"] = torch.randn(4, 32)
    tensors[f"{P}model.embed_tokens.lora_embedding_B"] = torch.randn(16, 4)
    write_adapter(root / "a", config={"target_modules": ["q_proj", "v_proj", "embed_tokens"]}, tensors=tensors)
    message = refused(store, "a")
    assert "model.embed_tokens.lora_embedding_" in message and "embeddings" in message


def test_tensors_for_a_module_the_base_lacks_are_invalid(store, root):
    tensors = lora_tensors()
    tensors[f"{P}model.embed_tokens.lora_A.weight"] = torch.randn(4, 32)
    tensors[f"{P}model.embed_tokens.lora_B.weight"] = torch.randn(16, 4)
    write_adapter(root / "a", config={"target_modules": ["q_proj", "v_proj", "embed_tokens"]}, tensors=tensors)
    message = refused(store, "a")
    assert f"{P}model.embed_tokens.lora_A.weight" in message
    assert "no LoRA-capable linear 'model.embed_tokens'" in message


def test_tensors_for_an_untargeted_module_are_invalid(store, root):
    write_adapter(root / "a", config={"target_modules": ["q_proj"]})  # the file also has v_proj tensors
    message = refused(store, "a")
    assert "v_proj.lora_A.weight" in message and "target_modules" in message


def test_missing_lora_b_is_invalid(store, root):
    tensors = lora_tensors()
    del tensors[f"{P}model.layers.0.self_attn.v_proj.lora_B.weight"]
    write_adapter(root / "a", tensors=tensors)
    message = refused(store, "a")
    assert "model.layers.0.self_attn.v_proj" in message and "lora_B.weight is missing" in message


def test_integer_tensors_are_invalid(store, root):
    tensors = lora_tensors()
    name = f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = torch.zeros(4, 16, dtype=torch.int32)
    write_adapter(root / "a", tensors=tensors)
    message = refused(store, "a")
    assert name in message and "expected floats" in message


def test_adapter_without_tensors_is_invalid(store, root):
    write_adapter(root / "a", tensors={"unrelated": torch.zeros(1)})
    assert "unrelated" in refused(store, "a")
    write_adapter(root / "b", tensors={})
    assert "no LoRA tensors" in refused(store, "b")


# ---- hub source: the local Hugging Face cache ---------------------------------------------------------

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An offline HF cache in tmp. huggingface_hub reads HF_HUB_CACHE into `constants` at import, and
    snapshot_download reads `constants.HF_HUB_CACHE` at each call: patch both (env for any subprocess)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: pathlib.Path, repo_id: str, **adapter_kw) -> pathlib.Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = write_adapter(repo / "snapshots" / SNAPSHOT, **adapter_kw)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot


def test_hub_adapter_loads_from_the_cache(hf_cache):
    tensors = lora_tensors(seed=7)
    cache_repo(hf_cache, "org/adapter", tensors=tensors)
    store = make_store(default_source="hub")
    try:
        adapter = store.load("org/adapter")
        assert adapter.adapter_id == "org/adapter"
        q1 = adapter.modules["model.layers.1.self_attn.q_proj"]
        assert torch.equal(q1.a, tensors[f"{P}model.layers.1.self_attn.q_proj.lora_A.weight"])
        assert store.loaded_ids() == ["org/adapter"]
    finally:
        store.close()


def test_hub_adapter_asked_for_from_a_local_default_store(hf_cache, root):
    cache_repo(hf_cache, "org/adapter")
    store = make_store(root)  # default source local
    try:
        assert store.key("org/adapter", "hub") == "hub:org/adapter"
        assert store.load("org/adapter", "hub").adapter_id == "hub:org/adapter"
        # "org/adapter" from the default (local) source is another adapter, and is not under the root
        assert "not found in the adapter roots" in refused(store, "org/adapter", AdapterNotFound)
    finally:
        store.close()


def test_hub_adapter_not_in_the_cache_is_not_found(hf_cache):
    store = make_store(default_source="hub")
    try:
        message = refused(store, "org/not-cached", AdapterNotFound)
        assert "'org/not-cached'" in message and "local Hugging Face cache" in message
    finally:
        store.close()


@pytest.mark.parametrize("repo_id", ["not//valid", "a/b/c", "bad id with spaces"])
def test_invalid_hub_repo_id_is_not_found(hf_cache, repo_id):
    store = make_store(default_source="hub")
    try:
        assert "not a valid Hugging Face repo id" in refused(store, repo_id, AdapterNotFound)
    finally:
        store.close()


def test_hub_adapter_is_checked_like_a_local_one(hf_cache):
    cache_repo(hf_cache, "org/too-big", r=16)
    store = make_store(default_source="hub")
    try:
        assert f"maximum LoRA rank {MAX_RANK}" in refused(store, "org/too-big")
    finally:
        store.close()


# ---- the CPU cache -----------------------------------------------------------------------------------


def test_lru_drops_the_least_recently_used(root, loads):
    for name in "abc":
        write_adapter(root / name)
    store = make_store(root, max_cpu_adapters=2)
    try:
        store.load("a"), store.load("b")
        asyncio.run(store.get("a"))  # a is now the most recently used
        store.load("c")
        assert sorted(store.loaded_ids()) == ["a", "c"]
        assert loads.calls == ["a", "b", "c"]
        store.load("b")  # dropped: read again, and now a is the least recently used
        assert loads.calls == ["a", "b", "c", "b"]
        assert sorted(store.loaded_ids()) == ["b", "c"]
    finally:
        store.close()


def test_preloaded_adapters_are_never_dropped(root, loads):
    for name in "pqabc":
        write_adapter(root / name)
    store = make_store(root, max_cpu_adapters=2)
    try:
        store.preload(["p", "q"])
        for name in "abc":
            store.load(name)
        assert sorted(store.loaded_ids()) == ["b", "c", "p", "q"]
        store.load("p"), store.load("q")
        assert loads.calls == ["p", "q", "a", "b", "c"]  # the preloaded ones were never read again
    finally:
        store.close()


def test_preloaded_adapters_stay_when_no_other_adapter_is_kept(root, loads):
    # --max-cpu-adapters 0: keep only the preloaded adapters in host memory.
    for name in "pa":
        write_adapter(root / name)
    store = make_store(root, max_cpu_adapters=0)
    try:
        store.preload(["p"])
        assert store.loaded_ids() == ["p"]
        assert set(store.load("a").modules) == set(BASE)  # served, then not kept
        assert store.loaded_ids() == ["p"]
        store.load("p")
        assert loads.calls == ["p", "a"]
    finally:
        store.close()


def test_concurrent_gets_of_one_adapter_share_one_read(root, monkeypatch):
    write_adapter(root / "a")
    gate = threading.Event()
    counter = CountingLoads(gate)
    monkeypatch.setattr(store_module, "load_adapter_dir", counter)
    store = make_store(root)

    async def open_gate():
        # Runs after every get below has started (tasks start in order) while the read is still held.
        gate.set()

    async def main():
        return await asyncio.gather(*(store.get("a") for _ in range(20)), open_gate())

    try:
        results = asyncio.run(main())[:-1]
        assert counter.calls == ["a"]
        assert all(r is results[0] for r in results)
        assert store.load("a") is results[0] and counter.calls == ["a"]
    finally:
        store.close()


def test_concurrent_gets_of_a_failing_adapter_share_one_read_and_all_fail(root, monkeypatch):
    write_adapter(root / "dora", config={"use_dora": True})
    gate = threading.Event()
    counter = CountingLoads(gate)
    monkeypatch.setattr(store_module, "load_adapter_dir", counter)
    store = make_store(root)

    async def open_gate():
        gate.set()

    async def main():
        return await asyncio.gather(*(store.get("dora") for _ in range(10)), open_gate(), return_exceptions=True)

    try:
        results = asyncio.run(main())[:-1]
        assert counter.calls == ["dora"]
        assert all(isinstance(r, AdapterInvalid) and "DoRA" in str(r) for r in results)
    finally:
        store.close()


def test_a_get_right_as_a_load_finishes_does_not_read_again(root, loads):
    """The moment between a finished read leaving the in-flight table and entering the cache: a request
    arriving then must get the loaded adapter, not start a second read."""
    write_adapter(root / "a")
    store = make_store(root)
    real_lock = store._lock
    late: list = []
    probed: list = []

    class ProbedLock:
        def __enter__(self):
            return real_lock.__enter__()

        def __exit__(self, *exc):
            result = real_lock.__exit__(*exc)
            # After the loader thread releases the lock with the read done, a new request arrives.
            if threading.current_thread().name.startswith("loraplex-adapters") and loads.calls and not probed:
                probed.append(True)
                late.append(store._future("a", lambda key: store._read(key, "a", None), True))
            return result

    store._lock = ProbedLock()
    try:
        first = store.load("a")
        assert late and late[0].result(timeout=30) is first
        assert loads.calls == ["a"]
    finally:
        store.close()


def test_a_refusal_is_remembered_for_a_while_then_the_files_are_read_again(root, loads):
    clock = [0.0]
    store = make_store(root, refusal_ttl_s=10.0, clock=lambda: clock[0])
    try:
        path = write_adapter(root / "a", r=16)  # above max rank
        assert "maximum LoRA rank" in refused(store, "a")
        write_adapter(path, r=4)  # fixed in place
        clock[0] = 9.9
        assert "maximum LoRA rank" in refused(store, "a")  # still the remembered refusal: no second read
        assert loads.calls == ["a"] and store.loaded_ids() == []
        clock[0] = 10.0
        assert set(store.load("a").modules) == set(BASE)
        assert loads.calls == ["a", "a"]
        assert store.loaded_ids() == ["a"]
    finally:
        store.close()


def test_not_found_is_not_cached(store, root):
    refused(store, "later", AdapterNotFound)
    write_adapter(root / "later")
    assert set(store.load("later").modules) == set(BASE)


# ---- merges ------------------------------------------------------------------------------------------


def test_merge_of_two_adapters_is_cached_and_not_listed(store, root, loads):
    write_adapter(root / "a", seed=1)
    write_adapter(root / "b", seed=2)
    spec = MergeSpec(("a", "b"), (0.5, 0.5), "linear")

    async def twice():
        return await store.get_merged(spec), await store.get_merged(spec)

    first, second = asyncio.run(twice())
    assert first is second and set(first.modules) == set(BASE)
    assert first.adapter_id == spec.key("local")
    assert sorted(loads.calls) == ["a", "b"]
    assert sorted(store.loaded_ids()) == ["a", "b"]


def test_merge_with_an_unknown_strategy_is_invalid(store, root, loads):
    write_adapter(root / "a")
    with pytest.raises(AdapterInvalid, match="merge_strategy 'average'"):
        asyncio.run(store.get_merged(MergeSpec(("a", "a"), (0.5, 0.5), "average")))
    with pytest.raises(AdapterInvalid, match="majority_sign_method 'vote'"):
        asyncio.run(store.get_merged(MergeSpec(("a", "a"), (0.5, 0.5), "ties", 0.5, "vote")))
    assert loads.calls == []  # refused before any adapter was read


def test_a_cat_merge_past_the_maximum_rank_is_invalid(store, root):
    write_adapter(root / "a", seed=1)
    write_adapter(root / "b", seed=2)
    write_adapter(root / "c", seed=3)
    two = asyncio.run(store.get_merged(MergeSpec(("a", "b"), (0.5, 0.5), "cat")))
    assert {w.rank for w in two.modules.values()} == {MAX_RANK}  # 4 + 4: at the maximum, served
    with pytest.raises(AdapterInvalid, match="'cat' merge has LoRA rank 12, above the maximum LoRA rank 8"):
        asyncio.run(store.get_merged(MergeSpec(("a", "b", "c"), (0.5, 0.5, 0.5), "cat")))


def test_merge_with_a_missing_adapter_is_not_found(store, root):
    write_adapter(root / "a")
    with pytest.raises(AdapterNotFound, match="'missing'"):
        asyncio.run(store.get_merged(MergeSpec(("a", "missing"), (0.5, 0.5))))


def test_merge_of_an_invalid_adapter_is_invalid(store, root):
    write_adapter(root / "a")
    write_adapter(root / "dora", config={"use_dora": True})
    with pytest.raises(AdapterInvalid, match="DoRA"):
        asyncio.run(store.get_merged(MergeSpec(("a", "dora"), (0.5, 0.5))))


def test_a_new_source_plugs_in_through_the_adapter_source_interface(tmp_path):
    """lora/sources/source.py: a source gives canonical ids and lends a directory; the store does the rest."""
    import contextlib

    shelf = {"first": write_adapter(tmp_path / "shelf" / "one", seed=1)}

    class Shelf:
        def canonical_id(self, adapter_id: str) -> str:
            if adapter_id.lower() not in shelf:
                raise AdapterNotFound(f"adapter {adapter_id!r} is not on the shelf")
            return adapter_id.lower()

        @contextlib.contextmanager
        def directory(self, canonical_id: str):
            yield shelf[canonical_id]

    store = AdapterStore(BASE, MAX_RANK, default_source="local", sources={"shelf": Shelf()})
    adapter = asyncio.run(store.get("FIRST", source="shelf"))
    assert adapter.adapter_id == "shelf:first" and set(adapter.modules) == set(BASE)
    assert asyncio.run(store.get("first", source="shelf")) is adapter  # one canonical id, one cache entry
    with pytest.raises(AdapterNotFound, match="not on the shelf"):
        asyncio.run(store.get("second", source="shelf"))
    with pytest.raises(AdapterInvalid, match="choose one of hub, local, s3, shelf"):
        asyncio.run(store.get("first", source="attic"))
