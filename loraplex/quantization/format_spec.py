"""What a pre-quantized checkpoint format is (`CheckpointFormat`), apart from how one is detected
(`checkpoint_format`): the format modules (fp8, w4a16_formats) build these, and checkpoint_format imports them, so
the class lives below both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class CheckpointFormat:
    name: str  # for the start-up log and errors: "gptq 4-bit, groups of 128"
    marker: str  # the tensor suffix that marks a quantized linear in the checkpoint ("qweight", "weight_packed")
    suffixes: tuple[str, ...]  # every tensor suffix a quantized linear owns, the marker included ("bias" never)
    # (tensors by suffix, as stored, on the device; the linear it replaces, on meta; device; compute dtype)
    #   -> the quantized layer (a QuantizedLinear: its `bias`, if any, is filled by the strict loader after)
    build: Callable[[dict[str, torch.Tensor], nn.Linear, torch.device, torch.dtype], nn.Module]
    # Checkpoint tensors the model does not use (regexes, re.search), e.g. KV-cache scales it cannot apply.
    ignored: tuple[str, ...] = ()
    # Options of the format the loader passes on (e.g. a KV-cache scheme), free-form.
    extras: dict[str, Any] = field(default_factory=dict)

    def keeps_stored_dtype(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a quantized linear (it is not cast to the model dtype)."""
        return name.rpartition(".")[2] in self.suffixes
