"""GPU kernels (Triton), each beside the torch reference it must match (`layers/attention.py` for attention)."""

from __future__ import annotations

import functools

import torch


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
