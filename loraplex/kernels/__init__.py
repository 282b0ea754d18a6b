"""What every Triton kernel of the package shares, below both `layers/kernels` and `lora/step/kernels` (neither imports
the other): whether Triton can run, and the direct launcher (launch.py)."""

from __future__ import annotations

import functools

import torch

from loraplex.environment import direct_launch_enabled


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(device: torch.device) -> bool:
    """Whether Triton kernels can run on `device` (CUDA with Triton installed)."""
    return device.type == "cuda" and _triton_importable()


def direct_launches() -> bool:
    """Whether Triton kernels launch directly (launch.py), as they do unless LORAPLEX_DIRECT_LAUNCH=0."""
    return direct_launch_enabled()
