"""GPU kernels (Triton), each beside the torch reference it must match (`layers/attention.py` for attention)."""

from __future__ import annotations

import functools

import torch

from loraplex.layers.forward_context import in_graph_warm_up


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
    capture (ForwardContext.graph_warm_up) takes them too, so that they are compiled and loaded before the capture
    starts."""
    return triton_available(device) and (in_graph_warm_up() or torch.cuda.is_current_stream_capturing())
