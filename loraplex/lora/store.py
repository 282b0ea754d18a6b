"""Where adapters come from and where they wait: sources on disk, and an LRU cache of loaded adapters.

Tiers: disk (a local adapter root, or the Hugging Face cache) -> this CPU cache (`max_cpu_adapters`,
least recently used dropped first) -> device slots (`LoraSlots`, given out by the scheduler). Loads
run on the store's own threads, never on the engine loop: a request whose adapter is loading waits
for it; nothing else does. Concurrent requests for one adapter share one load. A failed load fails
only the requests that asked for that adapter. A refusal (AdapterInvalid) is remembered for
`refusal_ttl_s`, so a stream of requests for a bad adapter does not redo the work; after that (or for
"not found") the next request tries again, so fixed files are picked up.

Sources:
- `local`: the id is a directory (absolute, or relative to an adapter root) that must resolve, after
  symlinks, inside one of the `roots`. No roots: local loading is off.
- `hub`: a Hugging Face repo id, read from the local HF cache; downloaded only when online and
  `HF_HUB_OFFLINE` is not set.
- `s3`: a directory in an S3 bucket, as LoRAX names it (lora/s3_source.py).
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
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from loraplex.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterInvalid,
    AdapterNotFound,
    BaseShapes,
    BaseWeight,
    CheckpointName,
    LoraAdapter,
    load_adapter_dir,
)
from loraplex.lora.merge import MAJORITY_SIGN_METHODS, MERGE_STRATEGIES, merge_adapters
from loraplex.lora.s3_source import s3_adapter_dir

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
        """The name an adapter has inside the engine: its id, qualified when not from the default source."""
        source = self.source_of(source)
        return adapter_id if source == self.default_source else f"{source}:{adapter_id}"

    def loaded_ids(self) -> list[str]:
        """Ids of the adapters in the CPU cache, as clients name them (merges excluded)."""
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
        return self._adapter_future(adapter_id, source).result()

    async def get(self, adapter_id: str, source: str | None = None) -> LoraAdapter:
        """As `load`, without blocking the event loop."""
        return await asyncio.wrap_future(self._adapter_future(adapter_id, source))

    async def get_merged(self, spec: MergeSpec, source: str | None = None) -> LoraAdapter:
        """The weighted merge of `spec.ids` (each loaded as by `get`), cached like any adapter."""
        _check_spec(spec)
        parts = [await self.get(adapter_id, source) for adapter_id in spec.ids]
        key = spec.key(self.source_of(source))
        return await asyncio.wrap_future(self._future(key, lambda k: _merge(k, parts, spec), listed=False))

    def _adapter_future(self, adapter_id: str, source: str | None) -> Future:
        key = self.key(adapter_id, source)
        return self._future(key, lambda k: self._read(k, adapter_id, source), self._listed(source))

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
            raise AdapterNotFound(f"adapter {adapter_id!r} cannot name a directory ({exc})") from exc
        raise AdapterNotFound(f"adapter {adapter_id!r} not found in the adapter roots")

    def _check_inside_roots(self, adapter_id: str, path: pathlib.Path) -> None:
        if not any(path.is_relative_to(root) for root in self.roots):
            raise AdapterInvalid(f"adapter {adapter_id!r} resolves outside the adapter roots (--adapter-root)")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _hub_dir(repo_id: str) -> pathlib.Path:
    """A hub adapter's snapshot directory (the HF cache; downloads only when online)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(repo_id, allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS], local_files_only=offline)
    except HFValidationError as exc:
        raise AdapterNotFound(f"adapter {repo_id!r} is not a valid Hugging Face repo id") from exc
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
