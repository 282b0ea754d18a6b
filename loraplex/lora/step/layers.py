"""LoRA-capable linears: thin wrappers that ask the step's LoRA plan (plan.py) for their deltas.

`wrap_linears` puts every `nn.Linear` of a model inside a `LoraLinear` (after the base weights are
loaded, so checkpoint names are untouched; wrapping twice is a no-op). The layers hold no adapter
state: each forward pass brings, through the forward context, the step's plan (which rows use which
slot, over the adapter table of the engine running it). So one model can serve several engines (as
tests do), and model code never changes.

A quantized base (bitsandbytes' Linear8bitLt / Linear4bit, put in by `loraplex.quantization` before the
wrappers go on) is wrapped the same way: both are `nn.Linear` subclasses with the real in/out features. The
adapter delta is computed from the layer's input in its dtype (the model's compute dtype, the dtype the adapter
table holds) and added to the base output, cast to that dtype if the base returned another.
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Sequence

import torch
from torch import nn

from loraplex.layers.forward_context import current_lora
from loraplex.layers.moe import MoeExperts
from loraplex.layers.projections import LinearWrapper
from loraplex.lora.step.experts import ExpertProjection, LoraExperts
from loraplex.quantization import dequantized_weight

# The kinds of row a LoRA-wrapped linear may read: the step's token rows, the rows handed to compute_logits
# (the output head), a vision tower's images (LLaVA: tiles; Mllama: whole images), cross-attention states
# (each request's own: an encoder's output, Mllama's image states) and an encoder's rows. Each request's rows of
# every kind use its adapter (lora/step/plan.py).
ROW_KINDS = ("tokens", "logits", "patches", "states", "encoder")


def row_kind(name: str, declared: Sequence[tuple[str, str]] = ()) -> str:
    """Which rows the linear `name` reads: the output head the logits rows; else the kind of the first of its model
    family's declared (glob, kind) pairs that matches (`linear_rows`, models/base.py); else the token rows."""
    if name.rsplit(".", 1)[-1] == "lm_head":
        return "logits"
    for pattern, kind in declared:
        if fnmatch.fnmatchcase(name, pattern):
            return kind
    return "tokens"


class LoraLinear(LinearWrapper):
    def __init__(self, base: nn.Linear, name: str, kind: str = "tokens") -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.row_kind = kind

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The base weight [out_features, in_features] as floats (a quantized base's, dequantized)."""
        return dequantized_weight(self.base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.around_product((self,), x, (self.out_features,), lambda: (self.base(x),))[0]

    def around_product(self, siblings: Sequence[LoraLinear], x: torch.Tensor, sizes: Sequence[int],
                       product: Callable[[], Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """The siblings' base outputs (`product()`) plus each row's adapter delta, as the step's plan adds them."""
        plan = current_lora()
        if plan is None:  # no adapter this step; a quantized base may compute in another dtype: outputs are x's
            return tuple(out if out.dtype == x.dtype else out.to(x.dtype) for out in product())
        return plan.add_to_product(siblings, x, sizes, product)


def wrap_linears(model: nn.Module) -> dict[str, LoraLinear | ExpertProjection]:
    """Wrap each nn.Linear of `model` (bitsandbytes' quantized linears included) in a LoraLinear, and each stacked
    experts module in a LoraExperts (once); module name -> layer, each expert's linears by name among them
    (lora/step/experts.py). Which rows each linear reads comes from the model's `linear_rows` (models/base.py)."""
    declared = tuple(getattr(model, "linear_rows", ()))
    unknown = {kind for _, kind in declared} - set(ROW_KINDS)
    assert not unknown, f"{type(model).__name__}.linear_rows names unknown row kinds {sorted(unknown)}"
    layers: dict[str, LoraLinear | ExpertProjection] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLinear):
            layers[name] = module
        elif isinstance(module, LoraExperts):
            layers.update(module.projections())
        elif isinstance(module, MoeExperts) and not name.endswith(".base"):
            parent_name, _, child = name.rpartition(".")
            experts = LoraExperts(module, name)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, experts)
            layers.update(experts.projections())
        elif isinstance(module, nn.Linear) and not name.endswith(".base"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = LoraLinear(module, name, row_kind(name, declared))
            setattr(parent, child, layer)
            layers[name] = layer
    return layers
