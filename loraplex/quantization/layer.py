"""The base of our own quantized linears (FP8, W4A16): an `nn.Linear` subclass, so that the LoRA wrapper wraps it
like any linear, that stores its weight in its own form and says how to read it back as floats."""

from __future__ import annotations

import torch
from torch import nn


class QuantizedLinear(nn.Linear):
    """A linear [in_features -> out_features] whose weight is stored quantized.

    Subclasses register their own tensors (as parameters or buffers, under the names their checkpoints use, so that
    the strict loader fills them), compute `forward(x)` in x's dtype, and give `dequantized()`: the weight
    [out_features, in_features] their product multiplies by, as floats (the LoRA merge and the tests read it).
    The bias, when there is one, is a plain parameter `bias` in the compute dtype.
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

    def quantized_tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer stores (for counting its bytes): parameters and buffers by default."""
        return [*self.parameters(recurse=False), *self.buffers(recurse=False)]

    def reset_parameters(self) -> None:  # nn.Linear's would initialise a float weight
        pass

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
