"""loraplex's environment switches, each read here and nowhere else. Read at every call, not at import, so
that a test (or an operator's shell) may set one after loraplex is imported."""

from __future__ import annotations

import os
import pathlib


def cache_dir_override() -> pathlib.Path | None:
    """LORAPLEX_CACHE: loraplex's cache directory (converted GGUF models, assembled example models), in
    place of the platform's user cache dir; None when unset or empty."""
    value = os.environ.get("LORAPLEX_CACHE")
    return pathlib.Path(value).expanduser() if value else None


def fused_projections_enabled() -> bool:
    """False when LORAPLEX_FUSE_PROJECTIONS=0: sibling projections (q/k/v, gate/up) stay one product each on
    CUDA, to compare against the fused product."""
    return os.environ.get("LORAPLEX_FUSE_PROJECTIONS", "1") != "0"


def direct_launch_enabled() -> bool:
    """False when LORAPLEX_DIRECT_LAUNCH=0: Triton kernels launch through Triton's own `JITFunction` instead
    of directly (layers/kernels/launch.py)."""
    return os.environ.get("LORAPLEX_DIRECT_LAUNCH", "1") != "0"


def torch_attention_forced() -> bool:
    """True when LORAPLEX_ATTENTION_BACKEND=torch: the torch reference attention even where Triton could run."""
    return os.environ.get("LORAPLEX_ATTENTION_BACKEND", "triton") == "torch"
