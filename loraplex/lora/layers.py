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

from typing import Callable, Sequence

import torch
from torch import nn

from loraplex.layers.forward_context import current_lora
from loraplex.layers.moe import MoeExperts
from loraplex.layers.projections import LinearWrapper
from loraplex.lora.experts import ExpertProjection, LoraExperts
from loraplex.quantization import dequantized_weight

# Which rows a LoRA-wrapped linear sees (DESIGN.md 7), by its module path: the output head sees the rows
# handed to compute_logits; a vision tower and its projector see images (LLaVA: tiles; Mllama: whole
# images), each owned by the request whose image it is; an encoder-decoder's encoder sees the encoder rows
# of the requests it runs for; cross-attention key/value projections see the states they read (an
# encoder's output, Mllama's image states), each request's own (`states`); everything else sees the
# step's token rows.
_IMAGE_MODULES = ("vision_tower.", "vision_model.", "multi_modal_projector")
_STATE_MODULES = (
    "EncDecAttention.k", "EncDecAttention.v", "encoder_attn.k_proj", "encoder_attn.v_proj",  # T5, BART
    "cross_attn.k_proj", "cross_attn.v_proj",  # Mllama
)
_ENCODER_STACKS = ("encoder", "model.encoder")  # T5's and BART's encoder stacks


def row_kind(name: str) -> str:
    if name.rsplit(".", 1)[-1] == "lm_head":
        return "logits"
    if any(part in name for part in _IMAGE_MODULES):
        return "patches"
    if name.endswith(_STATE_MODULES):
        return "states"
    if any(name.startswith(stack + ".") for stack in _ENCODER_STACKS):
        return "encoder"
    return "tokens"


class LoraLinear(LinearWrapper):
    def __init__(self, base: nn.Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.row_kind = row_kind(name)

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
    (lora/experts.py)."""
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
            layer = LoraLinear(module, name)
            setattr(parent, child, layer)
            layers[name] = layer
    return layers
