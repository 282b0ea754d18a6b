"""Private hub adapters (LoRAX issue 479): a request's api_token is checked on every request, not only at
the download, and the cache keeps one entry per token scope, so a private adapter a token holder loaded is
never served to a request without that token. The hub is a fake (tests/lora/fake_hub.py) that checks
tokens; the real source's own token handling is tested at the end with huggingface_hub's calls stubbed."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch

from loraplex.lora.adapter import AdapterInvalid, AdapterNotFound
from loraplex.lora.errors import AdapterSourceUnavailable
from loraplex.lora.sources.hub_source import PUBLIC, HuggingFaceHub, token_scope
from loraplex.lora.sources.store import AdapterStore, MergeSpec
from loraplex.params import SamplingParams
from tests.lora.fake_hub import COMMIT_A, COMMIT_B, FakeHub
from tests.lora.test_store import BASE, MAX_RANK, P, cache_repo, hf_cache, loads, lora_tensors, write_adapter  # noqa: F401

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
TOKEN = "hf_secretTokenOfTheOwner0123456789"
OTHER = "hf_someoneElsesToken9876543210abc"
Q0 = "model.layers.0.self_attn.q_proj"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def hub(tmp_path) -> FakeHub:
    hub = FakeHub()
    hub.publish("org/private", write_adapter(tmp_path / "private", seed=1), TOKEN)
    hub.publish("org/public", write_adapter(tmp_path / "public", seed=2))
    return hub


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(hub, clock):
    s = AdapterStore(BASE, MAX_RANK, default_source="hub", hub=hub, clock=clock, access_ttl_s=30.0)
    yield s
    s.close()


def refused(store: AdapterStore, adapter_id: str, token: str | None) -> str:
    with pytest.raises(AdapterNotFound) as info:
        store.load(adapter_id, api_token=token)
    return str(info.value)


def no_token_in(text: str) -> None:
    assert TOKEN not in text and OTHER not in text
    assert token_scope(TOKEN) not in text and token_scope(OTHER) not in text


def test_a_private_adapter_loaded_with_its_token_is_refused_without_it(store, hub, loads):
    adapter = store.load("org/private", api_token=TOKEN)
    assert adapter.adapter_id == "org/private"  # what clients, logs and metrics see
    for token in (None, "", OTHER):  # the files are cached, yet each is refused as if there were no such adapter
        message = refused(store, "org/private", token)
        assert message.startswith("adapter 'org/private' not found")
        no_token_in(message)
    assert store.load("org/private", api_token=TOKEN) is adapter  # the holder still has the cached entry
    assert loads.calls == ["org/private"]  # read once


def test_public_adapters_need_no_token(store):
    plain = store.load("org/public")
    assert plain.adapter_id == "org/public" and plain.key == f"org/public@{COMMIT_A}"
    assert store.load("org/public", api_token=OTHER).adapter_id == "org/public"  # a token changes nothing it may read
    assert store.loaded_ids() == ["org/public"]


def test_each_token_scope_has_its_own_entry_and_engine_key(store, hub):
    hub.publish("org/shared", hub.repos["org/private"].path, TOKEN, OTHER)
    mine, theirs = store.load("org/shared", api_token=TOKEN), store.load("org/shared", api_token=OTHER)
    assert mine is not theirs and mine.key != theirs.key  # never one device slot for two scopes
    assert mine.adapter_id == theirs.adapter_id == "org/shared"
    assert mine.key == f"org/shared@{COMMIT_A}#{token_scope(TOKEN)}"
    assert TOKEN not in mine.key and OTHER not in theirs.key
    assert store.loaded_ids() == []  # what a token reads is not listed for every client


def test_two_scopes_of_one_adapter_take_two_device_slots(make_engine):
    engine = make_engine(max_active_adapters=2)
    hub = FakeHub()
    hub.publish("org/shared", SHIPPED / "name-nova", TOKEN, OTHER)
    store = AdapterStore(engine.lora.base_shapes, engine.config.max_lora_rank, default_source="hub", hub=hub)
    try:
        mine, theirs = store.load("org/shared", api_token=TOKEN), store.load("org/shared", api_token=OTHER)
    finally:
        store.close()
    for adapter in (mine, theirs):
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), adapter=adapter)
    engine.step()
    assert sorted(engine.scheduler.slots.occupant) == sorted([mine.key, theirs.key])
    assert engine.adapter_ids["running"] == ["org/shared"]  # metrics see the id, once


def test_token_scopes_name_no_token():
    assert token_scope(None) == token_scope("") == PUBLIC
    scope = token_scope(TOKEN)
    assert scope == token_scope(TOKEN) != token_scope(OTHER)
    assert TOKEN not in scope and scope.startswith("token-")


def test_an_access_check_is_reused_for_its_own_scope_only_and_until_its_ttl(store, hub, clock):
    store.load("org/private", api_token=TOKEN)
    store.load("org/private", api_token=TOKEN)
    assert hub.asked == ["org/private"]  # the second request reused the first's answer
    refused(store, "org/private", None)
    refused(store, "org/private", OTHER)
    assert hub.asked == ["org/private"] * 3  # another scope never reuses it: the hub was asked each time
    hub.repos["org/private"].tokens = frozenset({OTHER})  # the owner's access is revoked
    clock.now = 29.0
    store.load("org/private", api_token=TOKEN)  # within the TTL
    clock.now = 31.0
    refused(store, "org/private", TOKEN)  # after it the hub is asked again, and says no
    assert store.load("org/private", api_token=OTHER).adapter_id == "org/private"


def test_without_a_ttl_every_request_asks_the_hub(hub):
    store = AdapterStore(BASE, MAX_RANK, default_source="hub", hub=hub, access_ttl_s=0.0)
    try:
        for _ in range(3):
            store.load("org/public")
        assert hub.asked == ["org/public"] * 3
    finally:
        store.close()


def test_a_new_commit_is_loaded_and_replaces_the_old_entry(store, hub, clock, tmp_path):
    old = store.load("org/public")
    new_weights = lora_tensors(seed=9)
    hub.publish("org/public", write_adapter(tmp_path / "public-v2", tensors=new_weights), revision=COMMIT_B)
    assert store.load("org/public") is old  # the answer is remembered for the TTL
    clock.now = 31.0
    new = store.load("org/public")
    assert new.key == f"org/public@{COMMIT_B}" and new.adapter_id == "org/public"
    assert torch.equal(new.modules[Q0].a, new_weights[f"{P}{Q0}.lora_A.weight"])
    assert store.loaded_ids() == ["org/public"] and old.key not in store._cache


def test_a_merge_with_a_private_part_needs_the_token(store):
    spec = MergeSpec(("org/private", "org/public"), (0.5, 0.5))
    merged = asyncio.run(store.get_merged(spec, api_token=TOKEN))
    for token in (None, OTHER):
        with pytest.raises(AdapterNotFound) as info:
            asyncio.run(store.get_merged(spec, api_token=token))
        assert str(info.value).startswith("adapter 'org/private' not found")
        no_token_in(str(info.value))
    assert asyncio.run(store.get_merged(spec, api_token=TOKEN)) is merged
    no_token_in(merged.adapter_id)


def test_async_get_checks_the_token_too(store):
    assert asyncio.run(store.get("org/private", api_token=TOKEN)).adapter_id == "org/private"
    with pytest.raises(AdapterNotFound):
        asyncio.run(store.get("org/private"))


def test_errors_of_a_private_adapter_name_the_id_not_the_entry(store, hub, tmp_path):
    hub.publish("org/too-big", write_adapter(tmp_path / "big", r=16), TOKEN)
    with pytest.raises(AdapterInvalid) as info:
        store.load("org/too-big", api_token=TOKEN)
    assert str(info.value).startswith("adapter 'org/too-big'") and "@" not in str(info.value)
    no_token_in(str(info.value))


def test_local_adapters_ignore_the_token(tmp_path):
    write_adapter(tmp_path / "root" / "a")
    store = AdapterStore(BASE, MAX_RANK, roots=[tmp_path / "root"], default_source="local")
    try:
        assert store.load("a", api_token=TOKEN) is store.load("a")
    finally:
        store.close()


# ---- the real source ---------------------------------------------------------------------------------


def test_offline_the_cache_is_served_with_or_without_a_token(hf_cache):  # noqa: F811
    cache_repo(hf_cache, "org/adapter")
    store = AdapterStore(BASE, MAX_RANK, default_source="hub")
    try:
        assert store.load("org/adapter").adapter_id == "org/adapter"
        assert store.load("org/adapter", api_token=TOKEN).adapter_id == "org/adapter"
    finally:
        store.close()


def test_online_the_hub_is_asked_with_the_requests_token(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    asked, downloads = [], []

    class Info:
        sha = COMMIT_A

    def model_info(self, repo_id, *, revision=None, token=None, **kw):
        asked.append((repo_id, revision, token))
        if token != TOKEN:  # as the hub does, with the token in the text to make sure it goes no further
            raise huggingface_hub.errors.RepositoryNotFoundError(f"401 for {repo_id} with {token}")
        return Info()

    def snapshot_download(repo_id, *, revision=None, token=None, **kw):
        downloads.append((repo_id, revision, token))
        return str(write_adapter(tmp_path / "snapshots" / revision))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    snapshot = HuggingFaceHub().resolve("org/private", None, TOKEN)
    assert snapshot.revision == COMMIT_A and snapshot.path.name == COMMIT_A
    assert downloads == [("org/private", COMMIT_A, TOKEN)]  # the commit the check answered, with the token
    for token, told in ((OTHER, "not found on the Hugging Face Hub, or not readable with this api_token"),
                        (None, "not found on the Hugging Face Hub (no api_token was sent: a private adapter needs one)")):
        with pytest.raises(AdapterNotFound) as info:
            HuggingFaceHub().resolve("org/private", None, token)
        assert str(info.value) == f"adapter 'org/private' {told}"
        assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained text carries it
    assert asked == [("org/private", None, TOKEN), ("org/private", None, OTHER), ("org/private", None, None)]


@pytest.mark.parametrize("failure, kind, told", [
    ("connect", AdapterSourceUnavailable, "the Hugging Face Hub cannot be reached from this server (ConnectError)"),
    ("5xx", AdapterSourceUnavailable, "the Hugging Face Hub cannot be reached from this server (HTTP 503)"),
    ("revision", AdapterNotFound, "has no revision 'v9' on the Hugging Face Hub"),
])
def test_hub_failures_name_their_real_cause(monkeypatch, failure, kind, told):
    """No network is not "not found"; a missing revision says so; the exception's own text (which may carry the
    token) is never repeated."""
    import httpx
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def model_info(self, repo_id, *, revision=None, token=None, **kw):
        request = httpx.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
        if failure == "connect":
            raise httpx.ConnectError(f"no route to host (token {token})", request=request)
        if failure == "5xx":
            response = httpx.Response(503, request=request)
            raise huggingface_hub.errors.HfHubHTTPError(f"503 with {token}", response=response)
        raise huggingface_hub.errors.RevisionNotFoundError(f"no {revision} with {token}", response=httpx.Response(404, request=request))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(kind) as info:
        HuggingFaceHub().resolve("org/adapter", "v9", TOKEN)
    assert told in str(info.value) and str(info.value).startswith("adapter 'org/adapter'") and TOKEN not in str(info.value)
