"""FP8 (e4m3) weights: `--quantize fp8` quantizes a float checkpoint's linears at load (per-channel weight scales,
dynamic per-token activation scales: fp8/layers.py Fp8Linear), and `detect` reads published FP8 checkpoints'
configs (fp8/formats.py)."""

from __future__ import annotations

import torch
from torch import nn

import loraplex.quantization.fp8.formats as fp8_formats
import loraplex.quantization.fp8.numerics as numerics
from loraplex.quantization.checkpoint_format_type import CheckpointFormat
from loraplex.quantization.errors import QuantizationError
from loraplex.quantization.fp8.layers import Fp8Linear


def check(device: torch.device, dtype: torch.dtype) -> None:
    """Raise QuantizationError where `--quantize fp8` cannot run: the CPU runs the emulation (tests); CUDA needs
    FP8 tensor cores and a half-precision compute dtype."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise QuantizationError(f"--quantize fp8 runs on CUDA FP8 GPUs (and emulated on the CPU), not on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise QuantizationError(
            f"--quantize fp8 needs an FP8 GPU (Ada/Hopper, compute capability 8.9+); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        raise QuantizationError(f"--quantize fp8 on CUDA computes in bfloat16 or float16, not "
                                f"{str(dtype).removeprefix('torch.')}: pass --dtype bfloat16")


def quantize_linear(linear: nn.Linear, device, dtype: torch.dtype) -> Fp8Linear:
    """A float nn.Linear -> an Fp8Linear on `device` (per-channel absmax / 448 scales; dynamic activations)."""
    weight, scale = numerics.quantize_per_channel(linear.weight.detach().to(device))
    bias = None if linear.bias is None else linear.bias.detach().to(device=device, dtype=dtype)
    return Fp8Linear(weight, scale, bias)


def detect(qconfig: dict) -> CheckpointFormat | None:
    """The FP8 format of a config.json `quantization_config`; None when it is not an FP8 one."""
    return fp8_formats.detect(qconfig)
