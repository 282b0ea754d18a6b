"""GPU kernels (Triton), each beside the torch reference it must match (`layers/attention.py` for attention)."""

from __future__ import annotations

import torch

from loraplex.kernels import direct_launches, triton_available
from loraplex.layers.forward_context import in_graph_warm_up


def fused_kernels_wanted(device: torch.device) -> bool:
    """Whether a layer should take its fused Triton kernel (elementwise.py, kv_write.py) rather than its torch ops.

    On CUDA: in eager steps when kernels launch directly (kernels/launch.py: a direct launch costs less host time
    than the several torch ops each replaces; an RMSNorm is eight of them), and always while a CUDA graph is
    captured, where a launch is paid once. Through Triton's own launch path the torch ops cost an eager step
    less. The eager pass before a capture (ForwardContext.graph_warm_up) takes them too, so that they are
    compiled and loaded before the capture starts."""
    return triton_available(device) and (
        direct_launches() or in_graph_warm_up() or torch.cuda.is_current_stream_capturing())
