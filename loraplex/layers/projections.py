"""Sibling projections (linears that read the same input: q/k/v, gate/up) in one matrix product.

A model names its siblings (`SIBLINGS` on the module that owns them, e.g. `(("q_proj", "k_proj", "v_proj"),)`)
and computes them with `project(self, x, names)`. After `fuse_projections(model)` the siblings' weights are views
of one concatenated weight and `project` multiplies by it once: on a GPU decoding one row, the three q/k/v
products were three launches each too small to reach the memory bandwidth (the 8B shape's k and v weights are
8 MB). Unfused, `project` calls each linear: the CPU path, and the checkpoint names, stay as they were.

A linear that keeps its own product (a quantized one) fuses with same-kind siblings through its class's
`fuse_siblings(linears) -> layer | None`: one layer of that kind computing the siblings' concatenated outputs
(their tensors become views of its own), which `project` then calls instead of the plain product.

The siblings may be wrapped (the LoRA layer, lora/step/layers.py) by a `LinearWrapper`, the one seam between them:
`project` hands the wrapper of the siblings the fused product to run (`around_product`), and the wrapper adds its
own terms to the outputs (and may start work that needs only the input before the product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LinearWrapper(nn.Module):
    """A module that holds a linear as `base` and adds a term of its own to the linear's output (the LoRA layer)."""

    base: nn.Module

    def around_product(self, siblings: Sequence["LinearWrapper"], x: torch.Tensor, sizes: Sequence[int],
                       product: Callable[[], Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """The outputs of `siblings` (this wrapper first; all of one type) for input x: `product()`, their linears'
        outputs (each sibling's `sizes` columns of one product, in order), plus each sibling's own term."""
        raise NotImplementedError


@dataclass(frozen=True)
class FusedWeights:
    weight: torch.Tensor  # [sum of out_features, in_features], each sibling's weight a view of it (a fused layer: its `_anchor`)
    bias: torch.Tensor | None
    sizes: tuple[int, ...]  # each sibling's out_features, in order
    layer: nn.Module | None = None  # the siblings' fused layer, where they keep their own product (quantized)

    def product(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = F.linear(x, self.weight, self.bias) if self.layer is None else self.layer(x)
        return out.split(self.sizes, dim=-1)


def project(owner: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """`x` through `owner`'s linears `names`: one product where they are fused, else one each."""
    linears = [getattr(owner, name) for name in names]
    fused = owner.__dict__.get("fused_projections", {}).get(names)
    # Stale when the module's parameters were replaced since (`model.to(...)` copies each on its own).
    if fused is None or _anchor(_inner(linears[0])).data_ptr() != fused.weight.data_ptr():
        return tuple(linear(x) for linear in linears)
    product = lambda: fused.product(x)  # noqa: E731
    first = linears[0]
    if isinstance(first, LinearWrapper) and all(type(linear) is type(first) for linear in linears):
        return first.around_product(linears, x, fused.sizes, product)  # the wrappers' terms, all at once
    return tuple(
        linear.around_product((linear,), x, (size,), lambda out=out: (out,))[0] if isinstance(linear, LinearWrapper)
        else out for linear, size, out in zip(linears, fused.sizes, product())
    )


def _inner(module: nn.Module) -> nn.Module:
    """The linear itself: what a wrapper holds as `base`, or the module."""
    return module.base if isinstance(module, LinearWrapper) else module


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear under `module` (itself, or what a wrapper holds), if it is a plain one (a quantized linear
    keeps its own product)."""
    linear = _inner(module)
    return linear if type(linear) is nn.Linear else None


def _fused_layer(owner: nn.Module, names: tuple[str, ...]) -> FusedWeights | None:
    """The siblings `names` as one layer of their own kind (`fuse_siblings`), when their class gives one."""
    linears = [_inner(getattr(owner, name)) for name in names]
    fuse = getattr(type(linears[0]), "fuse_siblings", None)
    if fuse is None or any(type(linear) is not type(linears[0]) for linear in linears):
        return None
    layer = fuse(linears)
    return None if layer is None else FusedWeights(_anchor(layer), None, tuple(l.out_features for l in linears), layer)


def _anchor(linear: nn.Module) -> torch.Tensor:
    """The tensor whose storage a fused group's siblings share (their weight; a layer that keeps its weight in
    another form names it `fused_anchor`): a sibling whose anchor is elsewhere was replaced since the fusion."""
    return getattr(linear, "fused_anchor", None) if getattr(linear, "weight", None) is None else linear.weight


def fuse_projections(model: nn.Module) -> int:
    """Concatenate the weights of every sibling group that can be (plain linears of one dtype and device, all
    with biases or none) and make each sibling's weight a view of the concatenation (no second copy is kept);
    siblings of a kind with its own product fuse through it (`fuse_siblings`). Fusing twice is a no-op. Returns
    how many groups are fused."""
    count = 0
    for owner in model.modules():
        for names in getattr(owner, "SIBLINGS", ()):
            fused = owner.__dict__.setdefault("fused_projections", {})
            if names in fused:
                count += 1
                continue
            linears = [_plain_linear(getattr(owner, name)) for name in names]
            if any(linear is None for linear in linears):
                own = _fused_layer(owner, names)
                if own is not None:
                    fused[names] = own
                    count += 1
                continue
            weights = [linear.weight for linear in linears]
            biases = [linear.bias for linear in linears]
            if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
                continue
            weight = torch.cat([w.detach() for w in weights])
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            sizes = tuple(w.shape[0] for w in weights)
            start = 0
            for linear, size in zip(linears, sizes):
                linear.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
                if bias is not None:
                    linear.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
                start += size
            fused[names] = FusedWeights(weight, bias, sizes)
            count += 1
    return count
