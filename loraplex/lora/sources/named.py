"""Adapters served under a name the operator chose: `--lora-modules name=path` at start-up, or a run-time load
(`POST /v1/load_lora_adapter`). A name is what clients send as `model` or `adapter_id`; it is looked up before
any source, and its adapter is held on the host for as long as the name is served (never dropped by the LRU).

Replacing a name's adapter (`load_inplace`) gives the new weights a new key, so requests already running keep the
slot and the weights they started with while new requests take the new ones; the prefix cache is keyed by the
weights' fingerprint, so no block the old weights computed is served to the new ones.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from loraplex.lora.adapter import AdapterInvalid, AdapterNotFound, LoraAdapter
from loraplex.lora.errors import AdapterNameTaken
from loraplex.lora.sources.s3_source import S3_PREFIX

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class AdapterModule:
    """One `--lora-modules` entry: `name=path`, or the JSON form {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "AdapterModule":
        """Raise ValueError saying what is wrong with the entry."""
        text = text.strip()
        if text.startswith("{"):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{text!r} is not valid JSON ({exc.msg})") from None
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
                raise ValueError(f"{text!r}: the JSON form needs string fields \"name\" and \"path\"")
            unknown = set(raw) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"{text!r}: unknown field(s) {', '.join(sorted(unknown))}")
            module = cls(raw["name"], raw["path"], raw.get("base_model_name"))
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"{text!r}: expected name=path or a JSON object")
            module = cls(name.strip(), path.strip())
        try:
            check_name(module.name)
        except AdapterInvalid as exc:
            raise ValueError(str(exc)) from None
        if not module.path:
            raise ValueError(f"adapter {module.name!r}: the path is empty")
        return module


def check_name(name: str) -> None:
    """A name clients can send: 1-256 printable characters, no surrounding spaces."""
    if not name or len(name) > MAX_NAME_CHARS or name != name.strip() or not name.isprintable():
        raise AdapterInvalid(f"adapter name {name[:64]!r} must be 1-{MAX_NAME_CHARS} printable characters, no spaces "
                             f"around it")


def source_of_path(path: str) -> str:
    """Which source a named adapter's path is read from: s3 for s3:// URIs, local for paths (absolute, ./ or ~),
    else the hub (a repo id; the store reads it from an adapter root instead where one holds such a directory)."""
    if path.startswith(S3_PREFIX):
        return "s3"
    if path.startswith(("/", "./", "../", "~")):
        return "local"
    return "hub"


def _taken(name: str) -> AdapterNameTaken:
    return AdapterNameTaken(f"adapter name {name!r} is taken; load it with load_inplace to replace it")


@dataclass(frozen=True)
class Named:
    adapter: LoraAdapter
    path: str
    pinned: bool  # keeps its device slot (SGLang's `pinned`)
    base_model_name: str | None = None  # its `parent` in /v1/models (vLLM's field; None: the served base)


class NamedAdapters:
    """name -> the adapter it serves now; thread-safe."""

    def __init__(self) -> None:
        self._by_name: dict[str, Named] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Named | None:
        with self._lock:
            return self._by_name.get(name)

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def check_free(self, name: str) -> None:
        if name in self:
            raise _taken(name)

    def put(self, name: str, named: Named, replace: bool) -> Named | None:
        """Serve `named` under `name`; the adapter it replaces (None: the name was free). AdapterNameTaken when the
        name serves one and `replace` is false."""
        with self._lock:
            old = self._by_name.get(name)
            if old is not None and not replace:
                raise _taken(name)
            self._by_name[name] = named
            return old

    def pop(self, name: str) -> Named:
        with self._lock:
            named = self._by_name.pop(name, None)
        if named is None:
            raise AdapterNotFound(f"no adapter is loaded under the name {name!r}")
        return named

    def all(self) -> dict[str, Named]:
        with self._lock:
            return dict(self._by_name)
