"""FP8 checkpoints as they are published, read from config.json's `quantization_config`:

- compressed-tensors (llm-compressor) `float-quantized`: `weight` e4m3 with `weight_scale` per channel [N, 1] or
  per tensor, or per [128, 128] block (strategy "block"); activations dynamic per token, or static per tensor
  (`input_scale`). Modules in its `ignore` list simply have no `weight_scale`.
- `quant_method: "fp8"`: transformers' FineGrainedFP8 (`weight_scale_inv`, blocks of `weight_block_size`, or per
  tensor when `weight_block_size` is null; a static scheme's `activation_scale`), and the older per-tensor form
  (AutoFP8, vLLM: no `weight_block_size` key; `weight_scale`, and `input_scale` when static).

A KV-cache scheme's scales (`k_scale`, `v_scale`) are taken by the loader (checkpoint_format.kv_cache_scales) for an
FP8 cache (`--kv-cache-dtype fp8`); the scheme is kept in `extras["kv_cache_scheme"]`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraplex.quantization.checkpoint_format_type import CheckpointFormat
from loraplex.quantization.errors import QuantizationError
from loraplex.quantization.fp8.layers import Fp8BlockLinear, Fp8Linear

FLOAT_QUANTIZED = "float-quantized"
KV_SCALES = (r"\.[kv]_scale$", r"\.kv_scale$", r"_proj\.output_scale$")


def detect(qconfig: dict) -> CheckpointFormat | None:
    method = qconfig.get("quant_method")
    if method == "fp8":
        return _transformers_fp8(qconfig)
    if method == "compressed-tensors":
        return _compressed_tensors(qconfig)
    return None


def _transformers_fp8(qconfig: dict) -> CheckpointFormat:
    scheme = qconfig.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"config.json: fp8 activation_scheme {scheme!r} is not served (dynamic or static)")
    static = scheme == "static"
    if "weight_block_size" not in qconfig:  # AutoFP8 / vLLM's per-tensor form
        return _per_channel_format(f"fp8 per-tensor, {scheme} activations", "weight_scale", "input_scale", static)
    block = qconfig["weight_block_size"]
    if block is None:
        return _per_channel_format(f"fp8 per-tensor, {scheme} activations", "weight_scale_inv", "activation_scale",
                                   static)
    if static:
        raise QuantizationError("config.json: fp8 with weight blocks and static activation scales is not served")
    if qconfig.get("scale_fmt", "float") != "float":
        raise QuantizationError(f"config.json: fp8 scale_fmt {qconfig['scale_fmt']!r} is not served (float)")
    return _block_format(f"fp8 blocks of {block[0]}x{block[1]}", "weight_scale_inv", tuple(block))


def _compressed_tensors(qconfig: dict) -> CheckpointFormat | None:
    groups = qconfig.get("config_groups") or {}
    formats = {group.get("format") or qconfig.get("format") for group in groups.values()} or {qconfig.get("format")}
    if FLOAT_QUANTIZED not in formats:
        return None  # pack-quantized (W4A16) and the rest: another format's
    if len(formats) > 1:
        raise QuantizationError(f"config.json: compressed-tensors mixing formats {sorted(map(str, formats))} "
                                "is not served")
    schemes = [_group_scheme(name, group) for name, group in groups.items()]
    if len(set(schemes)) != 1:
        raise QuantizationError("config.json: compressed-tensors float-quantized groups with different schemes "
                                "are not served")
    weights, block, static = schemes[0]
    extras: dict[str, Any] = {}
    if qconfig.get("kv_cache_scheme") is not None:
        extras["kv_cache_scheme"] = qconfig["kv_cache_scheme"]
    if weights == "block":
        if static:
            raise QuantizationError("config.json: compressed-tensors FP8 blocks with static activations are not served")
        return _block_format(f"compressed-tensors FP8 blocks of {block[0]}x{block[1]}", "weight_scale", block, extras)
    activations = "static" if static else "dynamic"
    return _per_channel_format(f"compressed-tensors FP8 per {weights}, {activations} activations", "weight_scale",
                               "input_scale", static, extras)


def _group_scheme(name: str, group: dict) -> tuple[str, tuple[int, int] | None, bool]:
    """(weight strategy, block shape, static activations) of one float-quantized group, or a QuantizationError."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    where = f"config.json: compressed-tensors group {name!r}"
    if weights.get("num_bits") != 8 or weights.get("type") != "float" or weights.get("symmetric") is False:
        raise QuantizationError(f"{where}: only symmetric 8-bit float (FP8) weights are served")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise QuantizationError(f"{where}: FP8 weight strategy {strategy!r} is not served (channel, tensor, block)")
    block = tuple(weights.get("block_structure") or ()) if strategy == "block" else None
    if block is not None and len(block) != 2:
        raise QuantizationError(f"{where}: FP8 block_structure {weights.get('block_structure')!r} is not served")
    if group.get("output_activations"):
        raise QuantizationError(f"{where}: quantized output activations are not served")
    if inputs is None:
        raise QuantizationError(f"{where}: FP8 weights with unquantized activations (W8A16) are not served")
    if inputs.get("num_bits") != 8 or inputs.get("type") != "float":
        raise QuantizationError(f"{where}: only FP8 input activations are served")
    dynamic = inputs.get("dynamic") is True
    strategy_in = inputs.get("strategy")
    if dynamic and strategy_in != ("group" if block else "token") or not dynamic and strategy_in != "tensor":
        raise QuantizationError(f"{where}: input activations {'dynamic' if dynamic else 'static'} per "
                                f"{strategy_in!r} are not served")
    return strategy, block, not dynamic


def _per_channel_format(name: str, scale: str, input_scale: str, static: bool,
                        extras: dict[str, Any] | None = None) -> CheckpointFormat:
    def build(tensors: dict[str, torch.Tensor], meta: nn.Linear, device: torch.device, dtype: torch.dtype) -> nn.Module:
        if static and input_scale not in tensors:
            raise KeyError(f"static activations need its {input_scale!r}")
        layer = Fp8Linear(_fp8(tensors["weight"], meta, device), tensors[scale].to(device),
                          input_scale=tensors[input_scale].to(device) if static else None)
        return _with_bias_slot(layer, meta, device, dtype)

    return CheckpointFormat(name, scale, ("weight", scale, input_scale), build, ignored=KV_SCALES,
                            extras=extras or {})


def _block_format(name: str, scale: str, block: tuple[int, int], extras: dict[str, Any] | None = None):
    def build(tensors: dict[str, torch.Tensor], meta: nn.Linear, device: torch.device, dtype: torch.dtype) -> nn.Module:
        layer = Fp8BlockLinear(_fp8(tensors["weight"], meta, device), tensors[scale].to(device), block)
        return _with_bias_slot(layer, meta, device, dtype)

    return CheckpointFormat(name, scale, ("weight", scale), build, ignored=KV_SCALES, extras=extras or {})


def _fp8(weight: torch.Tensor, meta: nn.Linear, device: torch.device) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"its weight is {weight.dtype}, not float8_e4m3fn")
    if tuple(weight.shape) != (meta.out_features, meta.in_features):
        raise ValueError(f"its weight is {tuple(weight.shape)}, the model wants {(meta.out_features, meta.in_features)}")
    return weight.to(device)


def _with_bias_slot(layer: nn.Module, meta: nn.Linear, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """An empty `bias` where the model's linear has one: the strict loader fills it with the checkpoint's."""
    if meta.bias is not None:
        layer.bias = nn.Parameter(torch.empty(meta.out_features, device=device, dtype=dtype), requires_grad=False)
    return layer
