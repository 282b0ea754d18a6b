"""The base of our own quantized linears (FP8, W4A16): an `nn.Linear` subclass, so that the LoRA wrapper wraps it
like any linear, that stores its weight in its own form and says how to read it back as floats."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

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


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A quantized layer's stored tensor: a parameter (so .to() and state_dict see it) that takes no gradient."""
    return nn.Parameter(tensor, requires_grad=False)


def fuse_by_channel(
    cls: type[QuantizedLinear], linears: Sequence[nn.Module], names: Sequence[str],
    key: Callable[[QuantizedLinear], Hashable],
    build: Callable[[list[torch.Tensor], torch.Tensor | None], QuantizedLinear],
) -> QuantizedLinear | None:
    """Siblings stored by output channel (dim 0 of each tensor in `names`) as one layer: `build(stacked, bias)` gets
    their tensors and biases concatenated in order, and each sibling's tensors then become row views of the fused
    layer's (no second copy). None unless every sibling is a `cls` and they agree on `key` (what one product needs
    alike: input width, device, bias, the subclass's options)."""
    if not all(type(linear) is cls for linear in linears) or len({key(linear) for linear in linears}) != 1:
        return None
    with torch.no_grad():
        stacked = [torch.cat([getattr(linear, name) for linear in linears]) for name in names]
        bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
        fused = build(stacked, bias)
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        for name in names:
            setattr(linear, name, frozen(getattr(fused, name)[rows]))
        if fused.bias is not None:
            linear.bias = frozen(fused.bias[rows])
        start += linear.out_features
    return fused


def common_key(linear: QuantizedLinear) -> tuple:
    """What any two fused siblings must share: the input width, the device, and the bias (or its absence)."""
    bias = linear.bias
    return linear.in_features, next(iter(linear.quantized_tensors())).device, None if bias is None else bias.dtype
