"""Pre-quantized checkpoints: a model directory whose config.json has a `quantization_config` (GPTQ, AWQ,
compressed-tensors, FP8) is loaded as it is published, each quantized linear built from its own tensors.

A format module (`fp8`, `w4a16`) gives `detect(quantization_config) -> CheckpointFormat | None`; `checkpoint_format`
asks each in turn. The loader then reads the checkpoint with the format's tensors kept in their stored dtypes
(`keeps_stored_dtype`), and `replace_quantized_linears` swaps each linear whose marker tensor is in the checkpoint
for the format's layer, built from that linear's tensors (taken out of the state), before the strict loader fills
the rest: every other tensor (embeddings, norms, biases, an unquantized head) loads as usual.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from loraplex.quantization.checkpoint_format_type import CheckpointFormat  # where the formats import it from
from loraplex.quantization.errors import QuantizationError


def _detectors() -> list[Callable[[dict], CheckpointFormat | None]]:
    from loraplex.quantization.fp8 import mode as fp8
    from loraplex.quantization.w4a16 import formats as w4a16_formats

    return [fp8.detect, w4a16_formats.detect]


def checkpoint_format(hf_config: dict) -> CheckpointFormat | None:
    """The quantized format config.json declares; None for a float checkpoint. A `quantization_config` no format
    reads is a QuantizationError naming its method."""
    qconfig = hf_config.get("quantization_config")
    if qconfig is None:
        return None
    if not isinstance(qconfig, dict):
        raise QuantizationError("config.json: quantization_config must be an object")
    for detect in _detectors():
        found = detect(qconfig)
        if found is not None:
            return found
    method = qconfig.get("quant_method", "?")
    raise QuantizationError(
        f"config.json: quantization_config {method!r} is not served; loraplex reads gptq, awq, fp8 and "
        "compressed-tensors (float-quantized FP8, pack-quantized W4A16) checkpoints"
    )


# An attention layer's calibrated KV-cache scales, as checkpoints name them: compressed-tensors' `self_attn.k_scale`
# (and its older `k_proj.output_scale`), AutoFP8's single `kv_scale` for both.
_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale|(kv)_scale)$")


def kv_cache_scales(state: dict[str, torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The KV-cache scales a checkpoint holds, {layer index: (k_scale, v_scale)} (float32, on the host), taken out
    of `state`; {} when it holds none. A layer with a key scale and no value scale (or the reverse) is refused."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name in [n for n in state if _KV_SCALE.search(n)]:
        match = _KV_SCALE.search(name)
        which = match.group(2) or match.group(3) or "kv"
        value = state.pop(name).detach().to("cpu", torch.float32).reshape(-1)
        for kind in ("k", "v") if which == "kv" else (which,):
            found.setdefault(int(match.group(1)), {})[kind] = value
    incomplete = sorted(i for i, kinds in found.items() if len(kinds) != 2)
    if incomplete:
        raise QuantizationError(f"layer {incomplete[0]} has a KV-cache scale for keys or values only")
    return {i: (kinds["k"], kinds["v"]) for i, kinds in sorted(found.items())}


def replace_quantized_linears(
    model: nn.Module, state: dict[str, torch.Tensor], fmt: CheckpointFormat, device: torch.device, dtype: torch.dtype
) -> int:
    """Swap each nn.Linear of `model` (built on meta) whose `<name>.<marker>` is in `state` for `fmt`'s layer,
    taking its tensors out of `state` (which must already use the model's names); returns how many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or f"{name}.{fmt.marker}" not in state:
            continue
        tensors = {s: state.pop(f"{name}.{s}") for s in fmt.suffixes if f"{name}.{s}" in state}
        try:
            layer = fmt.build(tensors, module, device, dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise QuantizationError(f"{name}: cannot load its {fmt.name} weights: {exc}") from exc
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        replaced += 1
    if replaced == 0:
        raise QuantizationError(f"config.json declares {fmt.name}, but no linear has a {fmt.marker!r} tensor")
    return replaced
