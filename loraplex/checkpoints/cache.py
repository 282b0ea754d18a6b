"""loraplex's cache directory and its entries: directories built once (a converted GGUF model, an assembled
example model) into a temporary directory, then renamed into place, so a crash never leaves half an entry."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Callable

from loraplex.environment import cache_dir_override


def print_to_stderr(msg: str) -> None:
    """The default `progress` of long builds and loads: one line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def cache_dir() -> pathlib.Path:
    """loraplex's cache directory: $LORAPLEX_CACHE, else the platform's user cache dir."""
    override = cache_dir_override()
    if override is not None:
        return override
    try:
        import platformdirs

        return pathlib.Path(platformdirs.user_cache_dir("loraplex"))
    except ImportError:  # platformdirs is a declared dependency; fall back to the XDG layout without it
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return pathlib.Path(base) / "loraplex"


def build_cached_dir(final: pathlib.Path, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """`final`, a cache entry holding a config.json: as it is, or made now by `build(tmp)` into a temporary
    directory beside it that is then renamed into place (atomic: the entry appears whole or not at all)."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent build that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_temp_dirs(final: pathlib.Path, older_than_s: float = 3600.0) -> None:
    now = time.time()
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if now - stale.stat().st_mtime > older_than_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
