"""FP8 (e4m3) linears: `--quantize fp8` and FP8 checkpoints. (Being built: see issue 36.)"""

from __future__ import annotations

from loraplex.quantization.errors import QuantizationError


def detect(qconfig: dict):
    return None


def check(device, dtype) -> None:
    raise QuantizationError("--quantize fp8 is not built yet")


def quantize_linear(linear, device, dtype):
    raise QuantizationError("--quantize fp8 is not built yet")
