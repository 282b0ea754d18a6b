"""Adapter ids: every alias of one adapter is one canonical id (one CPU-cache entry, one `/v1/models` entry, one
metric label), and nothing a client reads (error messages, the x-adapter-id header, the model list) carries a
server path or the alias another client used."""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest

from loraplex.lora.sources import store as store_module
from loraplex.lora.adapter import ADAPTER_WEIGHTS, AdapterError, AdapterInvalid, AdapterNotFound, LoraAdapter
from loraplex.lora.sources.store import AdapterStore, MergeSpec
from loraplex.server import request_log
from loraplex.server.state import ServerState, adapter_header
from tests.lora.test_store import BASE, MAX_RANK, CountingLoads, write_adapter


@pytest.fixture
def root(tmp_path) -> pathlib.Path:
    r = tmp_path / "root"
    write_adapter(r / "name-nova")
    write_adapter(r / "team" / "b", seed=1)
    return r


@pytest.fixture
def loads(monkeypatch) -> CountingLoads:
    counter = CountingLoads()
    monkeypatch.setattr(store_module, "load_adapter_dir", counter)
    return counter


@pytest.fixture
def store(root):
    s = AdapterStore(BASE, MAX_RANK, roots=[root], default_source="local")
    yield s
    s.close()


def aliases(root: pathlib.Path) -> list[str]:
    cwd = os.path.relpath(root / "name-nova", pathlib.Path.cwd())
    return [
        "name-nova/./", "name-nova/", "./name-nova", "nonexistent/../name-nova", "name-nova/nonexistent/..",
        "team/../name-nova", "name-nova/中/..", str(root / "name-nova"), str(root / "team" / ".." / "name-nova"),
        f"/proc/self/cwd/{cwd}",
    ]


def test_aliases_of_one_directory_are_one_adapter(store, root, loads):
    first = store.load("name-nova")
    for alias in aliases(root):
        assert store.key(alias) == "name-nova", alias
        assert store.load(alias) is first, alias
    assert loads.calls == ["name-nova"]  # read once, cached once
    assert store.loaded_ids() == ["name-nova"]


def test_an_absolute_path_is_named_relative_to_its_root(store, root):
    assert store.load(str(root / "team" / "b")).adapter_id == "team/b"
    assert sorted(store.loaded_ids()) == ["team/b"]


def test_a_symlink_is_named_by_the_directory_it_points_to(store, root, loads):
    (root / "alias").symlink_to(root / "name-nova", target_is_directory=True)
    assert store.load("alias") is store.load("name-nova")
    assert store.loaded_ids() == ["name-nova"] and loads.calls == ["name-nova"]


def test_a_directory_hidden_by_an_earlier_root_is_refused_not_named_by_its_path(tmp_path, root):
    second = tmp_path / "second"
    write_adapter(second / "name-nova", seed=2)
    store = AdapterStore(BASE, MAX_RANK, roots=[root, second], default_source="local")
    try:
        assert store.load("name-nova").adapter_id == "name-nova"  # the first root's
        with pytest.raises(AdapterInvalid) as info:
            store.load(str(second / "name-nova"))
        assert "hidden" in str(info.value)
        assert store.loaded_ids() == ["name-nova"]
    finally:
        store.close()


def test_nested_roots_give_each_directory_one_id(tmp_path):
    outer = tmp_path / "outer"
    write_adapter(outer / "inner" / "a")
    store = AdapterStore(BASE, MAX_RANK, roots=[outer / "inner", outer], default_source="local")
    try:
        assert store.key("a") == store.key("inner/a") == store.key(str(outer / "inner" / "a")) == "a"
    finally:
        store.close()


def test_merges_of_aliases_share_one_entry_and_are_never_listed(store, root, loads):
    async def merge(ids):
        return await store.get_merged(MergeSpec(ids, (0.5, 0.5)))

    first = asyncio.run(merge(("name-nova", "team/b")))
    assert asyncio.run(merge(("name-nova/./", str(root / "team" / "b")))) is first
    assert sorted(store.loaded_ids()) == ["name-nova", "team/b"]


# ---- hub and s3 ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("repo_id", ["org/a/../b", "org//a", "/abs/path", "org/a/", "中\n"])
def test_malformed_hub_ids_are_refused_before_any_lookup(repo_id, monkeypatch):
    class NoHub:
        def resolve(self, *args):
            pytest.fail("looked up")

    store = AdapterStore(BASE, MAX_RANK, default_source="hub", hub=NoHub())
    try:
        with pytest.raises(AdapterNotFound, match="not a valid Hugging Face repo id"):
            store.load(repo_id)
    finally:
        store.close()


def test_hub_ids_are_kept_exactly():
    store = AdapterStore(BASE, MAX_RANK, default_source="hub")
    try:
        assert store.key("Org/Adapter") == "Org/Adapter"
        assert store.key("org/adapter") == "org/adapter" != store.key("Org/Adapter")
    finally:
        store.close()


def test_s3_ids_naming_one_object_share_one_key(monkeypatch):
    monkeypatch.delenv("PREDIBASE_MODEL_BUCKET", raising=False)
    store = AdapterStore(BASE, MAX_RANK, default_source="s3")
    try:
        keys = {store.key(i) for i in ("s3://bucket/path", "bucket/path", "s3://bucket/path/", "bucket//path/")}
        assert keys == {"s3://bucket/path"}
        assert store.key("bucket/path", "s3") == "s3://bucket/path"
        assert store.key("s3://other/path") != "s3://bucket/path"
    finally:
        store.close()


# ---- what a client reads --------------------------------------------------------------------------


def message(store: AdapterStore, adapter_id: str, kind=AdapterError) -> str:
    with pytest.raises(kind) as info:
        store.load(adapter_id)
    return str(info.value)


def test_errors_name_the_id_the_client_gave_not_a_server_path(tmp_path, root):
    store = AdapterStore(BASE, MAX_RANK, roots=[root], default_source="local", refusal_ttl_s=0.0)
    try:
        (root / "empty").mkdir()
        (root / "corrupt").mkdir()
        (root / "corrupt" / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
        (root / "corrupt" / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
        (root / "escape").symlink_to(tmp_path, target_is_directory=True)
        cases = {
            "empty": AdapterNotFound, str(root / "empty"): AdapterNotFound, "corrupt/": AdapterInvalid,
            str(root / "corrupt"): AdapterInvalid, "escape": AdapterInvalid, "x" * 300: AdapterNotFound,
            "missing": AdapterNotFound,
        }
        for adapter_id, kind in cases.items():
            text = message(store, adapter_id, kind)
            assert text.startswith(f"adapter {adapter_id!r}"), text
            assert str(tmp_path) not in text.replace(adapter_id, ""), text
    finally:
        store.close()


def test_an_unreadable_config_names_no_path(root, monkeypatch):
    def denied(path, *args, **kw):
        raise PermissionError(13, "Permission denied", str(path))  # as an unreadable file would (tests run as root)

    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    store = AdapterStore(BASE, MAX_RANK, roots=[root], default_source="local")
    try:
        text = message(store, "name-nova", AdapterInvalid)
        assert "cannot be read" in text and str(root) not in text
    finally:
        store.close()


def test_a_shared_refusal_names_each_client_its_own_alias(root):
    (root / "name-nova" / ADAPTER_WEIGHTS).write_bytes(b"broken")
    store = AdapterStore(BASE, MAX_RANK, roots=[root], default_source="local")  # refusals remembered
    try:
        first = message(store, "name-nova/./secret-tenant-alias/..", AdapterInvalid)
        second = message(store, "name-nova", AdapterInvalid)
        assert first.startswith("adapter 'name-nova/./secret-tenant-alias/..': ")
        assert second.startswith("adapter 'name-nova': ") and "secret-tenant-alias" not in second
        assert first.partition(": ")[2] == second.partition(": ")[2]
    finally:
        store.close()


def test_the_adapter_header_carries_only_printable_ascii(store):
    adapter = store.load("name-nova/中/..")
    assert adapter_header(adapter) == {"x-adapter-id": "name-nova"}
    odd = LoraAdapter("t/中 a%b\x01", adapter.modules, adapter.config)
    value = adapter_header(odd)["x-adapter-id"]
    assert value == "t/%E4%B8%AD%20a%25b%01"
    assert value.isascii() and value.isprintable()
    assert adapter_header(None) == {}


def test_the_metric_label_is_the_canonical_id(store, root):
    state = ServerState(engine=None, config=None, metrics=None, adapters=store)
    record = request_log.RequestRecord("r", "POST", "/generate")

    async def serve(adapter_id=None, merged=None, source=None):
        token = request_log._current.set(record)
        try:
            request_log.note_adapter(adapter_id, merged.ids if merged else ())  # as the routes do
            await state.adapter(adapter_id, source, merged)
        finally:
            request_log._current.reset(token)

    asyncio.run(serve(str(root / "name-nova")))
    assert record.adapter == "name-nova"
    asyncio.run(serve(merged=MergeSpec(("name-nova/.", "team/b/"), (0.5, 0.5))))
    assert record.adapter == "name-nova,team/b"
    # Another source than the default: the label is the id, not the key ("local:team/b").
    state.adapters = AdapterStore(BASE, MAX_RANK, roots=[root], default_source="hub")
    try:
        asyncio.run(serve("./team/b", source="local"))
        assert record.adapter == "team/b"
    finally:
        state.adapters.close()
