"""Where adapters come from and where they wait: sources on disk, and an LRU cache of loaded adapters.

Tiers: disk (a local adapter root, or the Hugging Face cache) -> this CPU cache (`max_cpu_adapters`,
least recently used dropped first) -> device slots (`AdapterTable`, given out by the scheduler). Loads
run on the store's own threads, never on the engine loop: a request whose adapter is loading waits
for it; nothing else does. Concurrent requests for one adapter share one load. A failed load fails
only the requests that asked for that adapter. A refusal (AdapterInvalid) is remembered for
`refusal_ttl_s`, so a stream of requests for a bad adapter does not redo the work; after that (or for
"not found") the next request tries again, so fixed files are picked up.

Sources, and the canonical id each gives an adapter (one adapter = one id = one `/v1/models` entry, one
metric label, and one cache entry but for hub adapters, below; `key` computes it before the cache is
looked at). A request's `api_token` is for hub adapters only: local and s3 ones are the server's to serve.
A source of files is an `AdapterSource` (lora/sources/source.py: the extension point for a new one):
- `local`: a directory inside one of the `roots` (lora/sources/local_source.py). Canonical id: its path
  relative to the first root holding it.
- `s3`: a directory in an S3 bucket, as LoRAX names it (lora/sources/s3_source.py). Canonical id:
  `s3://bucket/path`, however the bucket was named.
- `hub`: a Hugging Face repo id. Canonical id: the repo id exactly as given; malformed ones are refused.
  Every request asks the hub (`HubSource`, lora/sources/hub_source.py) with its own `api_token` whether it may
  read the repo and at which commit (an answer is reused for `access_ttl_s`, for the same repo and token
  scope only); offline (`HF_HUB_OFFLINE`) the local HF cache is served to every client, tokens unchecked.
  Cache entries are keyed `id@commit`, plus `#scope` for a token ("public": none; otherwise a keyed hash
  of the token, never the token): a request without the token that loaded a private adapter, or with
  another, gets "not found" from the hub, never the cached entry. An adapter's `key` (what the engine
  keys slots by) is its entry's; its `adapter_id`, what clients, logs and metrics see, stays the id.
  Only public entries are listed; a newer commit's entry replaces the older one of the same scope.
- Names (lora/sources/named.py): `--lora-modules` and run-time loads serve an adapter under a name, looked up
  before any source.

Errors a client sees name the adapter by the id that client gave (never a server path, nor the alias
another client used for the same adapter: loads and refusals are shared).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import pathlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from loraplex.lora.adapter import (
    AdapterError,
    AdapterInvalid,
    AdapterNotFound,
    BaseShapes,
    BaseWeight,
    CheckpointName,
    LoraAdapter,
    load_adapter_dir,
)
from loraplex.lora.sources.hub_source import PUBLIC, HubSource, HuggingFaceHub, Snapshot, token_scope
from loraplex.lora.sources.named import Named, NamedAdapters, check_name, source_of_path
from loraplex.lora.layout import FlatFormat
from loraplex.lora.merge import MAJORITY_SIGN_METHODS, MERGE_STRATEGIES, merge_adapters
from loraplex.lora.sources.local_source import LocalSource
from loraplex.lora.sources.s3_source import S3Source
from loraplex.lora.sources.source import AdapterSource

# How long a refused adapter (AdapterInvalid) is answered from memory before its files are read again.
REFUSAL_TTL_S = 10.0
# How long the hub's answer to "may this token scope read this repo, and at which commit" is reused for
# requests of the same repo and scope (0: every request asks). Revoked access and new commits show after it.
ACCESS_TTL_S = 30.0


@dataclass(frozen=True)
class MergeSpec:
    """A weighted merge of several adapters (LoRAX's `merged_adapters`)."""

    ids: tuple[str, ...]
    weights: tuple[float, ...]
    strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"

    def key(self, source: str) -> str:
        spec = json.dumps([source, self.ids, self.weights, self.strategy, self.density, self.majority_sign_method])
        return "merged-" + hashlib.sha256(spec.encode()).hexdigest()[:16]


class AdapterStore:
    def __init__(
        self,
        base_shapes: BaseShapes,
        max_rank: int,
        roots: Sequence[str | os.PathLike] = (),
        default_source: str = "hub",
        max_cpu_adapters: int = 64,
        base_weight: BaseWeight | None = None,
        loader_threads: int = 2,
        refusal_ttl_s: float = REFUSAL_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        checkpoint_name: CheckpointName | None = None,
        hub: HubSource | None = None,
        access_ttl_s: float = ACCESS_TTL_S,
        sources: dict[str, AdapterSource] | None = None,
        flat_format: FlatFormat | None = None,
    ) -> None:
        # The sources of files (lora/sources/source.py, the extension point); the hub ("hub") is served beside them.
        self.local = LocalSource(roots)
        self.sources: dict[str, AdapterSource] = {"local": self.local, "s3": S3Source(), **(sources or {})}
        self.source_names = ("hub", *self.sources)
        if default_source not in self.source_names:
            raise ValueError(f"unknown adapter source {default_source!r}; choose one of {', '.join(self.source_names)}")
        self.base_shapes, self.max_rank, self.base_weight = base_shapes, max_rank, base_weight
        self.checkpoint_name = checkpoint_name  # the model's layout mapping, for adapters of another layout
        self.default_source = default_source
        self.max_cpu_adapters = max_cpu_adapters  # besides the preloaded ones
        self._cache: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._loading: dict[str, Future] = {}
        self._names: dict[str, str] = {}  # key -> the id a client uses (for listings)
        self._pinned: set[str] = set()  # names of preloaded adapters: never dropped from the cache
        self._families: dict[str, str] = {}  # hub key -> its repo and scope (a newer revision replaces it)
        self.hub = hub or HuggingFaceHub()
        self.access_ttl_s = access_ttl_s
        self._grants: dict[tuple[str, str], tuple[float, Snapshot]] = {}  # (repo, scope) -> (until, snapshot)
        self._refused: dict[str, tuple[float, AdapterInvalid]] = {}  # key -> (until, the refusal)
        self.refusal_ttl_s, self._clock = refusal_ttl_s, clock
        self._lock = threading.Lock()
        # Loads run beside the engine, in arrival order, `loader_threads` at a time, each thread at a lower CPU
        # priority than the engine's and the server's: a burst of cold adapters slows itself, not the running requests.
        self._pool = ThreadPoolExecutor(loader_threads, thread_name_prefix="loraplex-adapters",
                                        initializer=lower_thread_priority)
        self.flat_format = flat_format  # how loaded adapters are kept: in the slots' dtype, pinned, on a GPU engine
        self.named = NamedAdapters()  # adapters served under an operator's name (lora/sources/named.py)

    # ---- names -------------------------------------------------------------------------------------

    def source_of(self, source: str | None) -> str:
        source = source or self.default_source
        if source not in self.source_names:
            raise AdapterInvalid(f"adapter_source {source!r} is not served; choose one of {', '.join(self.source_names)}")
        return source

    def key(self, adapter_id: str, source: str | None = None) -> str:
        """The name clients, logs and metrics know an adapter by: its canonical id, qualified when not from the
        default source (hub entries are keyed by revision and token scope too, see `_adapter_future`).
        Raises AdapterNotFound / AdapterInvalid for ids that name no adapter of that source."""
        return self._adapter_names(adapter_id, source)[0]

    def _adapter_names(self, adapter_id: str, source: str | None) -> tuple[str, str]:
        """(key, canonical id)."""
        if source is None and adapter_id in self.named:  # a name is its own id
            return adapter_id, adapter_id
        source = self.source_of(source)
        canonical = self.canonical_id(adapter_id, source)
        return (canonical if source == self.default_source else f"{source}:{canonical}"), canonical

    def canonical_id(self, adapter_id: str, source: str) -> str:
        """The one id of the adapter `adapter_id` names in `source` (see the module's docstring); a served name is
        its own."""
        if adapter_id in self.named:
            return adapter_id
        if source != "hub":  # local: a few stat calls on the caller's thread, cheap next to a load
            return self.sources[source].canonical_id(adapter_id)
        _check_repo_id(adapter_id)
        return adapter_id

    def loaded_ids(self) -> list[str]:
        """The named adapters' names and the canonical ids of the default source's adapters in the CPU cache (merges
        excluded)."""
        with self._lock:
            cached = [self._names[k] for k in self._cache if k in self._names]
        return [*self.named.all(), *(i for i in cached if i not in self.named)]

    # ---- getting an adapter --------------------------------------------------------------------------

    def preload(self, adapter_ids: Sequence[str]) -> None:
        """Load adapters now (blocking) and keep them in the CPU cache for good."""
        for adapter_id in adapter_ids:
            with self._lock:  # pinned first, so that even a cache of size 0 keeps it
                self._pinned.add(self.key(adapter_id))
            self.load(adapter_id)

    def load(self, adapter_id: str, source: str | None = None, api_token: str | None = None) -> LoraAdapter:
        """The adapter, from the cache or loaded now (blocking). Raises AdapterNotFound / AdapterInvalid.
        `api_token`: the request's Hugging Face token, for hub adapters (see lora/sources/hub_source.py)."""
        named = self.named.get(adapter_id) if source is None else None
        if named is not None:
            return named.adapter
        names, future = self._adapter_future(adapter_id, source, api_token)
        try:
            return future.result()
        except AdapterError as exc:
            raise _as_named(exc, names, adapter_id) from exc

    async def get(self, adapter_id: str, source: str | None = None, api_token: str | None = None) -> LoraAdapter:
        """As `load`, without blocking the event loop."""
        named = self.named.get(adapter_id) if source is None else None
        if named is not None:
            return named.adapter
        start = functools.partial(self._adapter_future, adapter_id, source, api_token)
        names, future = await asyncio.to_thread(start) if self.source_of(source) == "hub" else start()  # asks the hub
        try:
            return await asyncio.wrap_future(future)
        except AdapterError as exc:
            raise _as_named(exc, names, adapter_id) from exc

    async def get_merged(
        self, spec: MergeSpec, source: str | None = None, api_token: str | None = None
    ) -> LoraAdapter:
        """The weighted merge of `spec.ids` (each loaded as by `get`), cached like any adapter."""
        _check_spec(spec)
        parts = [await self.get(adapter_id, source, api_token) for adapter_id in spec.ids]
        # Keyed by the parts' keys: canonical ids, and for hub parts their revisions and token scopes.
        spec = replace(spec, ids=tuple(part.key for part in parts))
        key = spec.key(self.source_of(source))
        return await asyncio.wrap_future(self._future(key, lambda k: _merge(k, parts, spec, self.max_rank)))

    def _adapter_future(
        self, adapter_id: str, source: str | None, api_token: str | None
    ) -> tuple[tuple[str, str], Future]:
        """((name, canonical id): the names its errors may give the adapter, the future).

        A hub adapter is asked of the hub first, with the request's token (`_granted`), and keyed by the
        commit the hub answered and the token's scope, so an updated repo is read again and an entry a token
        loaded is never handed to a request without that token. Listed (in /v1/models) are the default
        source's adapters, public scope only."""
        (name, canonical), source = self._adapter_names(adapter_id, source), self.source_of(source)
        listed = name if source == self.default_source else None
        if source != "hub":
            return (name, canonical), self._future(name, lambda k: self._read(k, canonical, source), listed)
        scope = token_scope(api_token)
        snapshot = self._granted(canonical, api_token, scope)
        key = f"{name}@{snapshot.revision}" + ("" if scope == PUBLIC else f"#{scope}")
        read = lambda k: replace(self._load_dir(snapshot.path, name), entry_key=k)  # noqa: E731
        listed = listed if scope == PUBLIC else None  # what one token reads is not shown to other clients
        return (name, canonical), self._future(key, read, listed, family=f"{name}#{scope}")

    def _granted(self, repo_id: str, api_token: str | None, scope: str) -> Snapshot:
        """The hub's answer for this repo and token, or the same scope's answer of the last `access_ttl_s`."""
        with self._lock:
            grant = self._grants.get((repo_id, scope))
            if grant is not None and self._clock() < grant[0]:
                return grant[1]
        snapshot = self.hub.resolve(repo_id, None, api_token)  # raises AdapterNotFound: nothing is remembered
        with self._lock:
            now = self._clock()
            self._grants = {k: g for k, g in self._grants.items() if now < g[0]}  # expired grants go
            if self.access_ttl_s > 0:
                self._grants[(repo_id, scope)] = (now + self.access_ttl_s, snapshot)
        return snapshot

    def _future(
        self, key: str, read: Callable[[str], LoraAdapter], name: str | None = None, family: str | None = None
    ) -> Future:
        """The cached adapter `key`, or its load. `name`: its listed name (None: unlisted); `family`: a hub
        adapter's repo and scope (its older revisions are dropped when it is cached)."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            if key in self._loading:
                return self._loading[key]
            refused = self._refused.get(key)
            if refused is not None and self._clock() < refused[0]:
                failed: Future = Future()
                failed.set_exception(refused[1])
                return failed
            self._refused.pop(key, None)
            future = self._pool.submit(self._load_and_cache, key, read, name, family)
            self._loading[key] = future
            return future

    def _load_and_cache(
        self, key: str, read: Callable[[str], LoraAdapter], name: str | None, family: str | None
    ) -> LoraAdapter:
        try:
            adapter = read(key)
            adapter.load_token = os.urandom(16)  # the prefix cache's key for it: its weights are not hashed
        except BaseException as exc:
            with self._lock:
                self._loading.pop(key, None)
                if isinstance(exc, AdapterInvalid):
                    self._refused[key] = (self._clock() + self.refusal_ttl_s, exc)
            raise
        with self._lock:  # one step from "loading" to "cached": a get in between would read it again
            self._loading.pop(key, None)
            # Requests in flight keep their own reference: dropping an adapter here never breaks them.
            for older in [k for k, f in self._families.items() if f == family and k != key]:
                self._drop(older)
            self._cache[key] = adapter
            if name is not None:
                self._names[key] = name
            if family is not None:
                self._families[key] = family
            unpinned = [k for k in self._cache if self._names.get(k) not in self._pinned]
            for evicted in unpinned[: max(0, len(unpinned) - self.max_cpu_adapters)]:
                self._drop(evicted)
        return adapter

    def _drop(self, key: str) -> None:
        self._cache.pop(key, None)
        self._names.pop(key, None)
        self._families.pop(key, None)

    def _read(self, name: str, canonical_id: str, source: str) -> LoraAdapter:
        """An adapter of a source of files (hub adapters are read from the snapshot `_granted` gave)."""
        with self.sources[source].directory(canonical_id) as path:  # s3: downloaded to a temporary directory
            return self._load_dir(path, name)

    def _load_dir(self, path: pathlib.Path, name: str) -> LoraAdapter:
        return load_adapter_dir(path, name, self.base_shapes, self.max_rank, self.base_weight, self.checkpoint_name,
                                self.flat_format)

    # ---- named adapters -------------------------------------------------------------------------------

    def register(self, name: str, path: str, inplace: bool = False, pinned: bool = False,
                 trusted: bool = False, base_model_name: str | None = None) -> tuple[LoraAdapter, LoraAdapter | None]:
        """Read, check and pack the adapter at `path` (a local directory, hub repo id or s3:// URI) and serve it under
        `name` (blocking): (the adapter, the one it replaced or None). A local path must lie inside the adapter
        roots unless `trusted` (the operator's --lora-modules). Raises AdapterNameTaken (the name serves one and
        `inplace` is false), AdapterNotFound or AdapterInvalid; on any error the name keeps what it served."""
        check_name(name)
        if not inplace:
            self.named.check_free(name)  # before the read: a taken name costs nothing
        adapter = self._read_path(path, name, trusted)
        # Keyed by its weights: a replacement takes a new device slot, while running requests keep the old one.
        adapter = adapter.keyed(f"{name}@{adapter.fingerprint.hex()[:16]}")  # its fingerprint carried over
        old = self.named.put(name, Named(adapter, path, pinned, base_model_name), inplace)
        return adapter, (old.adapter if old is not None else None)

    def unregister(self, name: str) -> LoraAdapter:
        """Stop serving `name` (AdapterNotFound if it serves nothing); its adapter, for the engine to retire."""
        return self.named.pop(name).adapter

    def _read_path(self, path: str, name: str, trusted: bool) -> LoraAdapter:
        source = source_of_path(path)
        # A repo-id-shaped path that names a directory: of an adapter root, or (the operator's) any.
        if source == "hub" and (self.local.holds(path) or (trusted and pathlib.Path(path).is_dir())):
            source = "local"
        if source == "s3" or (source == "local" and not trusted):
            adapter = self._read(name, self.sources[source].canonical_id(path), source)
        elif source == "hub":
            _check_repo_id(path)
            adapter = self._load_dir(self.hub.resolve(path, None, None).path, name)
        else:  # the operator's local path: anywhere
            directory = pathlib.Path(path).expanduser().resolve()
            if not directory.is_dir():
                raise AdapterNotFound(f"adapter {name!r}: {path} is not a directory")
            adapter = self._load_dir(directory, name)
        adapter.fingerprint  # hashed here, on the loading thread
        return adapter

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


LOADER_NICENESS = 10  # how much lower than the process's the loader threads' CPU priority is (Linux's nice, per thread)


def lower_thread_priority() -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads by their own nice value; elsewhere nothing)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + LOADER_NICENESS))
    except (AttributeError, OSError):  # no setpriority (Windows), or not allowed: loads still run
        pass


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise AdapterNotFound(f"adapter {repo_id!r} is not a valid Hugging Face repo id") from exc


def _as_named(exc: AdapterError, names: tuple[str, ...], adapter_id: str) -> AdapterError:
    """`exc` (raised once for everyone who asked for the adapter `names` name) naming it as this client did."""
    message, named = str(exc), f"adapter {adapter_id!r}"
    for prefix in (f"adapter {name!r}" for name in names):
        if message.startswith(prefix):
            return type(exc)(named + message[len(prefix):])
    return type(exc)(message)  # a fresh exception: the shared one is raised in several requests


def _check_spec(spec: MergeSpec) -> None:
    if spec.strategy not in MERGE_STRATEGIES:
        raise AdapterInvalid(f"merge_strategy {spec.strategy!r} is not served; choose one of {', '.join(MERGE_STRATEGIES)}")
    if spec.majority_sign_method not in MAJORITY_SIGN_METHODS:
        raise AdapterInvalid(
            f"majority_sign_method {spec.majority_sign_method!r} is not served; choose one of {', '.join(MAJORITY_SIGN_METHODS)}"
        )


def _merge(key: str, parts: list[LoraAdapter], spec: MergeSpec, max_rank: int) -> LoraAdapter:
    # A fixed seed: the same merge request always gives the same (DARE-pruned) adapter.
    merged = merge_adapters(
        key, parts, list(spec.weights), spec.strategy, spec.density, spec.majority_sign_method,
        generator=torch.Generator().manual_seed(0),
    )
    rank = max((weights.rank for weights in merged.modules.values()), default=0)
    if rank > max_rank:  # "cat" adds the parts' ranks up
        raise AdapterInvalid(
            f"the {spec.strategy!r} merge has LoRA rank {rank}, above the maximum LoRA rank {max_rank} (--max-lora-rank)"
        )
    return merged
