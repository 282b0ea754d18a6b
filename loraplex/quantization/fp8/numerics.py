"""FP8 (e4m3) numerics shared by every FP8 layer: quantizing activation rows and weights, and the scaled product,
on an FP8 GPU through `torch._scaled_mm` and elsewhere emulated with the same roundings (the reference).

The product of x [M, K] and a weight stored as e4m3 [N, K] with per-output-channel scales s_w [N]: x is quantized
per row (token) with scale s_x = amax(|row|) / 448 (or one static per-tensor scale from the checkpoint), rounded to
e4m3, the e4m3 values multiplied with float32 accumulation, and the result scaled by s_x * s_w, then rounded to the
output dtype. `_scaled_mm` does exactly that (rowwise scaling); the emulation does it in float32 on any device.
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# The smallest scale a row or channel takes: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (e4m3 weight [N, K], float32 scales [N]): each row scaled by its absmax / 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    return to_fp8(w / scale[:, None]), scale


def to_fp8(values: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> e4m3, saturated at +-448 (a cast alone would give NaN)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_torch(rows: torch.Tensor, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation rows [M, K] -> (e4m3 rows [M, K], float32 scales [M, 1]); per-row dynamic scales, or the one
    static scale (a float32 scalar) for every row. The reference of the Triton kernel (fp8/kernels.py)."""
    values = rows.float()
    if static_scale is None:
        scale = (values.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(rows.shape[0], 1).contiguous()
    return to_fp8(values / scale), scale


def emulated_scaled_mm(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """What `torch._scaled_mm` computes, in float32 on any device: (q @ weight.T) * q_scale * weight_scale."""
    product = q.float() @ weight.float().t()
    return (product * q_scale * weight_scale.reshape(1, -1)).to(out_dtype)


@functools.lru_cache(maxsize=None)
def _fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_usable(device: torch.device, in_features: int, out_features: int) -> bool:
    """Whether `torch._scaled_mm` can multiply on `device` by a weight of that shape: an FP8 GPU (compute
    capability 8.9+), and K and N multiples of 16 (cuBLASLt's FP8 layouts)."""
    if device.type != "cuda" or in_features % 16 or out_features % 16:
        return False
    return _fp8_tensor_cores(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))


def scaled_mm(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(q [M, K] e4m3 @ weight [N, K] e4m3 ^T) * q_scale [M, 1] * weight_scale_row [1, N] on the tensor cores.
    weight is stored row-major [N, K], so weight.t() is the column-major operand cuBLASLt wants. Rowwise scaling
    writes bfloat16: other dtypes are cast after."""
    out = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=weight_scale_row, out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
