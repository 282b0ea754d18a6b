"""GPU kernels (Triton), each beside the torch reference it must match (`layers/attention.py` for attention)."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

_warming_up = False  # an eager pass before a CUDA graph capture is running


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


def fused_kernels_wanted(device: torch.device) -> bool:
    """Whether a layer should take its fused Triton kernel (elementwise.py) rather than its torch ops: only while a
    CUDA graph is being captured. An eager Triton launch costs tens of microseconds of host time, more than the
    few small torch kernels it replaces; in a graph that cost is paid once, at capture. The eager pass before a
    capture (`graph_warm_up`) takes them too, so that they are compiled and loaded before the capture starts."""
    return triton_available(device) and (_warming_up or torch.cuda.is_current_stream_capturing())


@contextmanager
def graph_warm_up() -> Iterator[None]:
    """Around the eager run that precedes a CUDA graph capture: layers take the kernels the capture will."""
    global _warming_up
    previous, _warming_up = _warming_up, True
    try:
        yield
    finally:
        _warming_up = previous
