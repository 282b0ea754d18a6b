"""4-bit weight-only checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized). (Being built: see issue 36.)"""

from __future__ import annotations


def detect(qconfig: dict):
    return None
