"""Where adapters come from and where they wait: sources on disk, and an LRU cache of loaded adapters.

Tiers: disk (a local adapter root, or the Hugging Face cache) -> this CPU cache (`max_cpu_adapters`,
least recently used dropped first) -> device slots (`LoraSlots`, given out by the scheduler). Loads
run on the store's own threads, never on the engine loop: a request whose adapter is loading waits
for it; nothing else does. Concurrent requests for one adapter share one load. A failed load fails
only the requests that asked for that adapter. A refusal (AdapterInvalid) is remembered for
`refusal_ttl_s`, so a stream of requests for a bad adapter does not redo the work; after that (or for
"not found") the next request tries again, so fixed files are picked up.

Sources, and the canonical id each gives an adapter (one adapter = one id = one cache entry, one
`/v1/models` entry, one metric label; `key` computes it before the cache is looked at):
- `local`: the id is a directory (absolute, or relative to an adapter root) that must resolve, after
  symlinks, inside one of the `roots`. No roots: local loading is off. Canonical id: the resolved
  directory's path relative to the first root holding it (`name-nova`, never `name-nova/./` or an
  absolute path). A directory that this relative id would not reach (an earlier root holds one of the
  same name) is refused rather than named by its server path.
- `hub`: a Hugging Face repo id, read from the local HF cache; downloaded only when online and
  `HF_HUB_OFFLINE` is not set. Canonical id: the repo id exactly as given; malformed ones are refused.
- `s3`: a directory in an S3 bucket, as LoRAX names it (lora/s3_source.py). Canonical id:
  `s3://bucket/path`, however the bucket was named.

Errors a client sees name the adapter by the id that client gave (never a server path, nor the alias
another client used for the same adapter: loads and refusals are shared).
"""

from __future__ import annotations

import asyncio
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
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    AdapterInvalid,
    AdapterNotFound,
    BaseShapes,
    BaseWeight,
    CheckpointName,
    LoraAdapter,
    load_adapter_dir,
)
from loraplex.lora.merge import MAJORITY_SIGN_METHODS, MERGE_STRATEGIES, merge_adapters
from loraplex.lora.s3_source import S3_PREFIX, bucket_and_prefix, s3_adapter_dir

SOURCES = ("local", "hub", "s3")
# How long a refused adapter (AdapterInvalid) is answered from memory before its files are read again.
REFUSAL_TTL_S = 10.0


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
    ) -> None:
        if default_source not in SOURCES:
            raise ValueError(f"unknown adapter source {default_source!r}; choose one of {', '.join(SOURCES)}")
        self.base_shapes, self.max_rank, self.base_weight = base_shapes, max_rank, base_weight
        self.checkpoint_name = checkpoint_name  # the model's layout mapping, for adapters of another layout
        self.roots = [pathlib.Path(r).expanduser().resolve() for r in roots]
        for root in self.roots:
            if not root.is_dir():
                raise ValueError(f"adapter root {root} is not a directory")
        self.default_source = default_source
        self.max_cpu_adapters = max_cpu_adapters  # besides the preloaded ones
        self._cache: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._loading: dict[str, Future] = {}
        self._names: dict[str, str] = {}  # key -> the id a client uses (for listings)
        self._pinned: set[str] = set()  # preloaded: never dropped from the cache
        self._refused: dict[str, tuple[float, AdapterInvalid]] = {}  # key -> (until, the refusal)
        self.refusal_ttl_s, self._clock = refusal_ttl_s, clock
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(loader_threads, thread_name_prefix="loraplex-adapters")

    # ---- names -------------------------------------------------------------------------------------

    def source_of(self, source: str | None) -> str:
        source = source or self.default_source
        if source not in SOURCES:
            raise AdapterInvalid(f"adapter_source {source!r} is not served; choose one of {', '.join(SOURCES)}")
        return source

    def key(self, adapter_id: str, source: str | None = None) -> str:
        """The name an adapter has inside the engine: its canonical id, qualified when not from the default
        source. Raises AdapterNotFound / AdapterInvalid for ids that name no adapter of that source."""
        return self._adapter_names(adapter_id, source)[0]

    def _adapter_names(self, adapter_id: str, source: str | None) -> tuple[str, str]:
        """(key, canonical id)."""
        source = self.source_of(source)
        canonical = self.canonical_id(adapter_id, source)
        return (canonical if source == self.default_source else f"{source}:{canonical}"), canonical

    def canonical_id(self, adapter_id: str, source: str) -> str:
        """The one id of the adapter `adapter_id` names in `source` (see the module's docstring)."""
        if source == "local":
            # A few stat calls on the caller's thread: cheap next to a load, and needed before the cache.
            return self._local_id(adapter_id)
        if source == "s3":
            bucket, prefix = bucket_and_prefix(adapter_id)
            return f"{S3_PREFIX}{bucket}/{prefix}"
        _check_repo_id(adapter_id)
        return adapter_id

    def loaded_ids(self) -> list[str]:
        """Canonical ids of the default source's adapters in the CPU cache (merges excluded)."""
        with self._lock:
            return [self._names[k] for k in self._cache if k in self._names]

    # ---- getting an adapter --------------------------------------------------------------------------

    def preload(self, adapter_ids: Sequence[str]) -> None:
        """Load adapters now (blocking) and keep them in the CPU cache for good."""
        for adapter_id in adapter_ids:
            with self._lock:  # pinned first, so that even a cache of size 0 keeps it
                self._pinned.add(self.key(adapter_id))
            self.load(adapter_id)

    def load(self, adapter_id: str, source: str | None = None) -> LoraAdapter:
        """The adapter, from the cache or loaded now (blocking). Raises AdapterNotFound / AdapterInvalid."""
        names, future = self._adapter_future(adapter_id, source)
        try:
            return future.result()
        except AdapterError as exc:
            raise _as_named(exc, names, adapter_id) from exc

    async def get(self, adapter_id: str, source: str | None = None) -> LoraAdapter:
        """As `load`, without blocking the event loop."""
        names, future = self._adapter_future(adapter_id, source)
        try:
            return await asyncio.wrap_future(future)
        except AdapterError as exc:
            raise _as_named(exc, names, adapter_id) from exc

    async def get_merged(self, spec: MergeSpec, source: str | None = None) -> LoraAdapter:
        """The weighted merge of `spec.ids` (each loaded as by `get`), cached like any adapter."""
        _check_spec(spec)
        parts = [await self.get(adapter_id, source) for adapter_id in spec.ids]
        spec = replace(spec, ids=tuple(part.adapter_id for part in parts))  # keyed by canonical ids
        key = spec.key(self.source_of(source))
        return await asyncio.wrap_future(self._future(key, lambda k: _merge(k, parts, spec), listed=False))

    def _adapter_future(self, adapter_id: str, source: str | None) -> tuple[tuple[str, str], Future]:
        """((key, canonical id): the names its errors may give the adapter, the future)."""
        (key, canonical), source = self._adapter_names(adapter_id, source), self.source_of(source)
        return (key, canonical), self._future(key, lambda k: self._read(k, canonical, source), self._listed(source))

    def _listed(self, source: str | None) -> bool:
        """Listed adapters are those a client can name by their key alone (the default source's)."""
        return self.source_of(source) == self.default_source

    def _future(self, key: str, read: Callable[[str], LoraAdapter], listed: bool) -> Future:
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
            future = self._pool.submit(self._load_and_cache, key, read, listed)
            self._loading[key] = future
            return future

    def _load_and_cache(self, key: str, read: Callable[[str], LoraAdapter], listed: bool) -> LoraAdapter:
        try:
            adapter = read(key)
            adapter.fingerprint  # hashed here, on the loading thread, not on the engine's
        except BaseException as exc:
            with self._lock:
                self._loading.pop(key, None)
                if isinstance(exc, AdapterInvalid):
                    self._refused[key] = (self._clock() + self.refusal_ttl_s, exc)
            raise
        with self._lock:  # one step from "loading" to "cached": a get in between would read it again
            self._loading.pop(key, None)
            self._cache[key] = adapter
            if listed:
                self._names[key] = key
            # Requests in flight keep their own reference: dropping an adapter here never breaks them.
            unpinned = [k for k in self._cache if k not in self._pinned]
            for evicted in unpinned[: max(0, len(unpinned) - self.max_cpu_adapters)]:
                del self._cache[evicted]
                self._names.pop(evicted, None)
        return adapter

    def _read(self, key: str, adapter_id: str, source: str | None) -> LoraAdapter:
        source = self.source_of(source)
        if source == "s3":  # downloaded to a temporary directory for the read
            with s3_adapter_dir(adapter_id) as path:
                return load_adapter_dir(path, key, self.base_shapes, self.max_rank, self.base_weight, self.checkpoint_name)
        path = self._local_dir(adapter_id) if source == "local" else _hub_dir(adapter_id)
        return load_adapter_dir(path, key, self.base_shapes, self.max_rank, self.base_weight, self.checkpoint_name)

    # ---- sources -----------------------------------------------------------------------------------

    def _local_id(self, adapter_id: str) -> str:
        """The resolved directory's path relative to the first root holding it."""
        path = self._local_dir(adapter_id)
        root = next(root for root in self.roots if path.is_relative_to(root))
        relative = path.relative_to(root).as_posix()
        if self._local_dir(relative) != path:  # only reachable by its absolute path: not given a name
            raise AdapterInvalid(
                f"adapter {adapter_id!r} is hidden by the adapter {relative!r} of an earlier adapter root"
            )
        return relative

    def _local_dir(self, adapter_id: str) -> pathlib.Path:
        if not self.roots:
            raise AdapterNotFound(
                f"adapter {adapter_id!r}: local adapters are off (start the server with --adapter-root DIR)"
            )
        try:
            given = pathlib.Path(adapter_id).expanduser()
            candidates = [given] if given.is_absolute() else [root / given for root in self.roots]
            for candidate in candidates:
                resolved = candidate.resolve()
                self._check_inside_roots(adapter_id, resolved)
                if resolved.is_dir():
                    # The files too: a symlinked file must not reach outside the roots either.
                    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                        self._check_inside_roots(adapter_id, (resolved / name).resolve())
                    return resolved
        except (ValueError, OSError, RuntimeError) as exc:  # NUL bytes, names too long, unknown ~user
            # Not `exc` itself: an OSError's text carries the server's path.
            raise AdapterNotFound(f"adapter {adapter_id!r} cannot name a directory ({type(exc).__name__})") from exc
        raise AdapterNotFound(f"adapter {adapter_id!r} not found in the adapter roots")

    def _check_inside_roots(self, adapter_id: str, path: pathlib.Path) -> None:
        if not any(path.is_relative_to(root) for root in self.roots):
            raise AdapterInvalid(f"adapter {adapter_id!r} resolves outside the adapter roots (--adapter-root)")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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


def _hub_dir(repo_id: str) -> pathlib.Path:
    """A hub adapter's snapshot directory (the HF cache; downloads only when online)."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(repo_id, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS], local_files_only=offline)
    except Exception as exc:  # noqa: BLE001 — not cached / no network / no such repo: all "not found"
        where = "in the local Hugging Face cache" if offline else "on the Hugging Face Hub or in its cache"
        raise AdapterNotFound(f"adapter {repo_id!r} not found {where}") from exc
    return pathlib.Path(path)


def _check_spec(spec: MergeSpec) -> None:
    if spec.strategy not in MERGE_STRATEGIES:
        raise AdapterInvalid(f"merge_strategy {spec.strategy!r} is not served; choose one of {', '.join(MERGE_STRATEGIES)}")
    if spec.majority_sign_method not in MAJORITY_SIGN_METHODS:
        raise AdapterInvalid(
            f"majority_sign_method {spec.majority_sign_method!r} is not served; choose one of {', '.join(MAJORITY_SIGN_METHODS)}"
        )


def _merge(key: str, parts: list[LoraAdapter], spec: MergeSpec) -> LoraAdapter:
    # A fixed seed: the same merge request always gives the same (DARE-pruned) adapter.
    return merge_adapters(
        key, parts, list(spec.weights), spec.strategy, spec.density, spec.majority_sign_method,
        generator=torch.Generator().manual_seed(0),
    )
