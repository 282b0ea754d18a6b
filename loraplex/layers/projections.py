"""Sibling projections (linears that read the same input: q/k/v, gate/up) in one matrix product.

A model names its siblings (`SIBLINGS` on the module that owns them, e.g. `(("q_proj", "k_proj", "v_proj"),)`)
and computes them with `project(self, x, names)`. After `fuse_projections(model)` the siblings' weights are views
of one concatenated weight and `project` multiplies by it once: on a GPU decoding one row, the three q/k/v
products were three launches each too small to reach the memory bandwidth (the 8B shape's k and v weights are
8 MB). Unfused, `project` calls each linear: the CPU path, and the checkpoint names, stay as they were.

The siblings may be wrapped (the LoRA layer): a wrapper that adds to its linear's output exposes
`add_to(out, x)`, which `project` calls with the linear's slice of the fused output, or, for siblings wrapped
alike, `begin_siblings` before the product and `add_siblings_to` after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class FusedWeights:
    weight: torch.Tensor  # [sum of out_features, in_features]; each sibling's weight is a view of it
    bias: torch.Tensor | None
    sizes: tuple[int, ...]  # each sibling's out_features, in order


def project(owner: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """`x` through `owner`'s linears `names`: one product where they are fused, else one each."""
    linears = [getattr(owner, name) for name in names]
    fused = owner.__dict__.get("fused_projections", {}).get(names)
    # Stale when the module's parameters were replaced since (`model.to(...)` copies each on its own).
    if fused is None or getattr(linears[0], "base", linears[0]).weight.data_ptr() != fused.weight.data_ptr():
        return tuple(linear(x) for linear in linears)
    wrapped = all(type(linear) is type(linears[0]) for linear in linears) and hasattr(linears[0], "add_siblings_to")
    # LoRA work that needs only x may start before the product (a CUDA graph's shrink, beside it).
    early = linears[0].begin_siblings(linears, x, fused.sizes) if wrapped else None
    outputs = F.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)
    if wrapped:
        return linears[0].add_siblings_to(linears, outputs, x, early)  # LoRA deltas, all siblings' at once where it can
    return tuple(
        linear.add_to(out, x) if hasattr(linear, "add_to") else out for linear, out in zip(linears, outputs)
    )


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear under `module` (itself, or what a wrapper holds as `base`), if it is a plain one (a
    quantized linear keeps its own product)."""
    linear = getattr(module, "base", module)
    return linear if type(linear) is nn.Linear else None


def fuse_projections(model: nn.Module) -> int:
    """Concatenate the weights of every sibling group that can be (plain linears of one dtype and device, all
    with biases or none) and make each sibling's weight a view of the concatenation (no second copy is kept).
    Fusing twice is a no-op. Returns how many groups are fused."""
    count = 0
    for owner in model.modules():
        for names in getattr(owner, "SIBLINGS", ()):
            fused = owner.__dict__.setdefault("fused_projections", {})
            if names in fused:
                count += 1
                continue
            linears = [_plain_linear(getattr(owner, name)) for name in names]
            if any(linear is None for linear in linears):
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
