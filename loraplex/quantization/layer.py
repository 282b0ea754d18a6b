"""The base of our own quantized linears (FP8, W4A16): an `nn.Linear` subclass, so that the LoRA wrapper wraps it
like any linear, that stores its weight in its own form and says how to read it back as floats."""

from __future__ import annotations

import torch
from torch import nn


class QuantizedLinear(nn.Linear):
    """A linear [in_features -> out_features] whose weight is stored quantized.

    A layer is built whole, from its checkpoint's tensors (checkpoint_format.replace_quantized_linears) or from a
    float linear (--quantize), before the strict loader runs: so its state dict holds only its `bias` (a plain
    parameter in the compute dtype, when there is one), the one tensor that loader fills. Subclasses keep their own
    tensors in whatever layout their kernel reads, compute `forward(x)` in x's dtype, and give `dequantized()`: the
    weight [out_features, in_features] their product multiplies by, as floats (the LoRA merge and the tests read it).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a float weight
        self.in_features, self.out_features = in_features, out_features
        self.register_parameter("weight", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def quantized_tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer stores (for counting its bytes): parameters and buffers by default."""
        return [*self.parameters(recurse=False), *self.buffers(recurse=False)]

    def reset_parameters(self) -> None:  # nn.Linear's would initialise a float weight
        pass

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
