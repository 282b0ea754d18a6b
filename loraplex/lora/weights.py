"""One module's LoRA weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraWeights:
    """One module's LoRA: delta(x) = scale * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "LoraWeights":
        return LoraWeights(self.a.to(device, dtype), self.b.to(device, dtype), self.scale)
