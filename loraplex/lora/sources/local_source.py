"""Local adapters: directories inside the adapter roots (`--adapter-root`), after symlinks, files included.

Canonical id: the resolved directory's path relative to the first root holding it (`name-nova`, never `name-nova/./`
or an absolute path). A directory that this relative id would not reach (an earlier root holds one of the same
name) is refused rather than named by its server path. No roots: local loading is off.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator, Sequence

from loraplex.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterInvalid, AdapterNotFound


class LocalSource:
    def __init__(self, roots: Sequence[str | os.PathLike]) -> None:
        self.roots = [pathlib.Path(r).expanduser().resolve() for r in roots]
        for root in self.roots:
            if not root.is_dir():
                raise ValueError(f"adapter root {root} is not a directory")

    def canonical_id(self, adapter_id: str) -> str:
        """The resolved directory's path relative to the first root holding it."""
        path = self._directory(adapter_id)
        root = next(root for root in self.roots if path.is_relative_to(root))
        relative = path.relative_to(root).as_posix()
        if self._directory(relative) != path:  # only reachable by its absolute path: not given a name
            raise AdapterInvalid(
                f"adapter {adapter_id!r} is hidden by the adapter {relative!r} of an earlier adapter root"
            )
        return relative

    @contextlib.contextmanager
    def directory(self, canonical_id: str) -> Iterator[pathlib.Path]:
        yield self._directory(canonical_id)

    def holds(self, path: str) -> bool:
        """Whether some root has a directory `path` (a name that could also be a hub repo id)."""
        return any((root / path).is_dir() for root in self.roots)

    def _directory(self, adapter_id: str) -> pathlib.Path:
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
