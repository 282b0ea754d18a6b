"""4-bit weight-only checkpoints as they are published, each read into `w4a16.W4A16Linear`:

- GPTQ (AutoGPTQ / GPTQModel `checkpoint_format: "gptq"`, v1): qweight int32 [K/8, N] (8 input features a word, the
  first in the low bits), qzeros int32 [K/g, N/8] (8 columns a word; v1 stores zero - 1), scales [K/g, N], g_idx [K]
  (act-order: each feature's group);
- AWQ (AutoAWQ `version: "gemm"`): qweight int32 [K, N/8] and qzeros [K/g, N/8], 8 columns a word in AWQ's
  interleaved order (nibble i holds column AWQ_PACK_ORDER[i] of its eight), scales [K/g, N];
- compressed-tensors `pack-quantized` (llm-compressor): weight_packed int32 [N, K/8] (values + 8, the first feature in
  the low bits), weight_scale [N, K/g], weight_zero_point int32 [N/8, K/g] packed along N (asymmetric only),
  weight_shape [2], weight_g_idx [K] (actorder "group").

All three dequantize to (q - zero) * scale. `detect(quantization_config)` returns the format's CheckpointFormat,
None for a config another module reads (FP8), and raises QuantizationError, on one line, for a 4-bit variant or an
integer scheme this module does not read.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from loraplex.quantization.checkpoint_format_type import CheckpointFormat
from loraplex.quantization.errors import QuantizationError
from loraplex.quantization.w4a16.mode import W4A16Linear

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP_SIZES = (32, 64, 128)  # and per-channel
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Each int32 of `packed` split into its 8 nibbles (low bits first), laid along `dim` (8x longer)."""
    shifts = _SHIFTS.to(packed.device).view([8 if d == dim + 1 else 1 for d in range(packed.dim() + 1)])
    values = (packed.unsqueeze(dim + 1) >> shifts) & 0xF
    shape = list(packed.shape)
    shape[dim] *= 8
    return values.reshape(shape)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [rows, N/8] words -> [rows, N] values in column order."""
    rows, words = packed.shape
    nibbles = _nibbles(packed, 1).reshape(rows, words, 8)
    by_column = torch.empty_like(nibbles)
    by_column[:, :, list(AWQ_PACK_ORDER)] = nibbles
    return by_column.reshape(rows, words * 8)


def _tensor(tensors: dict[str, torch.Tensor], suffix: str, shape: tuple[int, ...], integer: bool) -> torch.Tensor:
    if suffix not in tensors:
        raise ValueError(f"{suffix} is missing")
    tensor = tensors[suffix]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{suffix} has shape {list(tensor.shape)}, expected {list(shape)}")
    if integer and tensor.dtype != torch.int32:
        raise ValueError(f"{suffix} is {str(tensor.dtype).removeprefix('torch.')}, expected int32")
    if not integer and not tensor.is_floating_point():
        raise ValueError(f"{suffix} is {str(tensor.dtype).removeprefix('torch.')}, expected floats")
    return tensor


def _groups(k: int, group_size: int) -> tuple[int, int]:
    """(group size, number of groups) of a linear with k input features; -1: one group (per-channel)."""
    size = k if group_size == -1 else group_size
    if k % size != 0 or k % 8 != 0:
        raise ValueError(f"{k} input features are not a whole number of groups of {size}")
    return size, k // size


def _build_gptq(group_size: int, tensors: dict[str, torch.Tensor], linear: nn.Linear, device: torch.device,
                dtype: torch.dtype) -> W4A16Linear:
    k, n = linear.in_features, linear.out_features
    size, groups = _groups(k, group_size)
    q = _nibbles(_tensor(tensors, "qweight", (k // 8, n), True), 0)
    zeros = _nibbles(_tensor(tensors, "qzeros", (groups, n // 8), True), 1) + 1  # v1 stores zero - 1
    scales = _tensor(tensors, "scales", (groups, n), False)
    g_idx = _tensor(tensors, "g_idx", (k,), True) if "g_idx" in tensors else None
    return W4A16Linear(q, zeros, scales, size, g_idx, linear.bias is not None, device, dtype)


def _build_awq(group_size: int, tensors: dict[str, torch.Tensor], linear: nn.Linear, device: torch.device,
               dtype: torch.dtype) -> W4A16Linear:
    k, n = linear.in_features, linear.out_features
    size, groups = _groups(k, group_size)
    q = _awq_columns(_tensor(tensors, "qweight", (k, n // 8), True))
    zeros = _awq_columns(_tensor(tensors, "qzeros", (groups, n // 8), True))
    scales = _tensor(tensors, "scales", (groups, n), False)
    return W4A16Linear(q, zeros, scales, size, None, linear.bias is not None, device, dtype)


def _build_pack_quantized(group_size: int, symmetric: bool, tensors: dict[str, torch.Tensor], linear: nn.Linear,
                          device: torch.device, dtype: torch.dtype) -> W4A16Linear:
    k, n = linear.in_features, linear.out_features
    size, groups = _groups(k, group_size)
    if "weight_shape" not in tensors:
        raise ValueError("weight_shape is missing")
    shape = [int(v) for v in tensors["weight_shape"].reshape(-1).tolist()]
    if shape != [n, k]:
        raise ValueError(f"weight_shape is {shape}, expected {[n, k]}")
    q = _nibbles(_tensor(tensors, "weight_packed", (n, k // 8), True), 1).t()
    scales = _tensor(tensors, "weight_scale", (n, groups), False).t()
    if symmetric:
        zeros = torch.full((groups, n), 8, dtype=torch.int32, device=q.device)
    else:
        packed_zeros = _tensor(tensors, "weight_zero_point", ((n + 7) // 8, groups), True)
        zeros = _nibbles(packed_zeros, 0)[:n].t()
    g_idx = _tensor(tensors, "weight_g_idx", (k,), True) if "weight_g_idx" in tensors else None
    return W4A16Linear(q, zeros, scales, size, g_idx, linear.bias is not None, device, dtype)


def _group_size(value, method: str) -> int:
    size = -1 if value in (None, -1) else int(value)
    if size != -1 and size not in GROUP_SIZES:
        raise QuantizationError(f"{method}: group_size {size} is not served; loraplex reads groups of "
                                f"{', '.join(map(str, GROUP_SIZES))} and per-channel (-1)")
    return size


def _name(method: str, group_size: int, extra: str = "") -> str:
    groups = "per-channel" if group_size == -1 else f"groups of {group_size}"
    return f"{method} 4-bit, {groups}{extra}"


def _gptq(qconfig: dict) -> CheckpointFormat:
    bits = qconfig.get("bits")
    if bits != 4:
        raise QuantizationError(f"gptq: {bits}-bit checkpoints are not served; loraplex reads 4-bit GPTQ")
    layout = qconfig.get("checkpoint_format", "gptq") or "gptq"
    if layout != "gptq":
        raise QuantizationError(f"gptq: checkpoint_format {layout!r} is not served; loraplex reads 'gptq' (v1)")
    size = _group_size(qconfig.get("group_size"), "gptq")
    act_order = ", act-order" if qconfig.get("desc_act") else ""
    return CheckpointFormat(_name("gptq", size, act_order), "qweight", ("qweight", "qzeros", "scales", "g_idx"),
                            functools.partial(_build_gptq, size))


def _awq(qconfig: dict) -> CheckpointFormat:
    bits = qconfig.get("bits", qconfig.get("w_bit"))
    if bits != 4:
        raise QuantizationError(f"awq: {bits}-bit checkpoints are not served; loraplex reads 4-bit AWQ")
    version = str(qconfig.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"awq: version {version!r} is not served; loraplex reads AWQ 'gemm' checkpoints")
    if not qconfig.get("zero_point", True):
        raise QuantizationError("awq: zero_point false is not served; loraplex reads AWQ with zero points")
    size = _group_size(qconfig.get("group_size", qconfig.get("q_group_size")), "awq")
    return CheckpointFormat(_name("awq", size), "qweight", ("qweight", "qzeros", "scales"),
                            functools.partial(_build_awq, size))


def _compressed_tensors(qconfig: dict) -> CheckpointFormat | None:
    groups = list((qconfig.get("config_groups") or {}).values())
    weights = [group.get("weights") or {} for group in groups]
    if not weights or all(w.get("type") == "float" for w in weights):
        return None  # FP8 (fp8.detect), or nothing quantized
    formats = {group.get("format") or qconfig.get("format") for group in groups}
    method = "compressed-tensors"
    if formats != {"pack-quantized"}:
        raise QuantizationError(f"{method}: format {', '.join(sorted(map(str, formats)))} is not served with "
                                "integer weights; loraplex reads 'pack-quantized' (W4A16)")
    if any(group.get("input_activations") for group in groups):
        raise QuantizationError(f"{method}: quantized activations with integer weights are not served; "
                                "loraplex reads weight-only 'pack-quantized' (W4A16)")
    first = weights[0]
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder")
    if any(tuple(w.get(key) for key in keys) != tuple(first.get(key) for key in keys) for w in weights[1:]):
        raise QuantizationError(f"{method}: config groups with different weight schemes are not served")
    if first.get("num_bits") != 4 or first.get("type") != "int":
        raise QuantizationError(f"{method}: {first.get('num_bits')}-bit {first.get('type')} pack-quantized "
                                "weights are not served; loraplex reads 4-bit integer weights")
    strategy = first.get("strategy")
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"{method}: strategy {strategy!r} is not served; loraplex reads 'group' and "
                                "'channel'")
    size = _group_size(first.get("group_size") if strategy == "group" else -1, method)
    symmetric = bool(first.get("symmetric", True))
    actorder = f", actorder {first['actorder']}" if first.get("actorder") else ""
    extra = f"{'' if symmetric else ', asymmetric'}{actorder}"
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    return CheckpointFormat(_name(f"{method} pack-quantized", size, extra), "weight_packed", suffixes,
                            functools.partial(_build_pack_quantized, size, symmetric))


def detect(qconfig: dict) -> CheckpointFormat | None:
    """The 4-bit format `quantization_config` declares; None when it is not one of GPTQ, AWQ or
    compressed-tensors with integer weights."""
    method = str(qconfig.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(qconfig)
    if method == "awq":
        return _awq(qconfig)
    if method == "compressed-tensors":
        return _compressed_tensors(qconfig)
    return None
