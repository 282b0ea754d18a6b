"""PEFT's LoRA on a mixture of experts' stacked parameters, cut into each expert's projections.

PEFT 0.21 on transformers 5 (whose experts are stacked, layers/moe.py) writes expert LoRA as `target_parameters`:
one `ParamWrapper` LoRA per stacked parameter (`experts.gate_up_proj`, `experts.down_proj`; PEFT converts Mixtral's
`target_modules` w1/w2/w3 to these itself, doubling r and alpha for the fused w1+w3), A [E * r, in] and
B [out, E * r], expert e's pair being rows e*r..(e+1)*r of A and columns e, e+E, e+2E ... of B (PEFT's
`ParamWrapper.get_delta_weight`), scaled by the config's alpha / r for the parameter's name. A module with both
parameters targeted nests the wrappers: the parameter registered last (down_proj) is the outer one, its tensors
`experts.lora_A.weight`, the other's `experts.base_layer.lora_A.weight` (the shapes, checked, tell them apart too).

`stacked_parameter_loras` cuts them into the per-expert projections the adapter table holds (lora/step/experts.py):
gate_up_proj's B split by rows into gate_proj's and up_proj's, its A shared by both. That is exact: each
projection's delta is its rows of the stacked parameter's delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from loraplex.layers.moe import MoeExperts
from loraplex.lora.errors import AdapterInvalid


# The stacked parameters in the order the experts register them (PEFT nests its wrappers in this order, the last
# outermost), each with the per-expert projections whose outputs it holds side by side.
STACKED_PARAMETERS = {"gate_up_proj": MoeExperts.PRODUCTS["gate_up"], "down_proj": MoeExperts.PRODUCTS["down"]}


@dataclass(frozen=True)
class ExpertSlice:
    """One expert projection's LoRA, cut from the tensors of a PEFT LoRA on a stacked parameter."""

    parameter: str  # the stacked parameter as PEFT names it (its rank and scale are the config's for this name)
    a_key: str
    b_key: str
    a_index: tuple[slice, ...]  # the projection's A [r, in] = tensors[a_key][a_index]
    b_index: tuple[slice, ...]  # its B [out, r] = tensors[b_key][b_index]


def is_stacked_experts(module: str, base: Mapping[str, tuple[int, int]]) -> bool:
    """Whether `module` (our name) is a stacked experts module of the base model (its experts' projections are)."""
    return f"{module}.0.down_proj" in base


def stacked_parameter_loras(
    saved: str, module: str, wrappers: Sequence[tuple[str, str]], targeted: Sequence[str],
    base: Mapping[str, tuple[int, int]], rank: Callable[[str], int],
    shape: Callable[[str], tuple[int, ...]],
) -> dict[str, ExpertSlice]:
    """Per-expert projection name -> its slice, for the LoRA PEFT put on stacked experts module `module` (`saved`
    as PEFT named it): `wrappers` the (lora_A, lora_B) keys of each nested wrapper, outermost first; `targeted`
    the stacked parameters the config targets there (`STACKED_PARAMETERS` order); `rank(name)` the config's rank
    of a parameter; `shape(key)` a tensor's shape. Raises AdapterInvalid where the tensors do not fit."""
    if not is_stacked_experts(module, base):
        raise AdapterInvalid(f"tensor {wrappers[0][0]}: the base model has no stacked experts {module!r} for its "
                             f"target_parameters LoRA")
    if len(wrappers) != len(targeted):
        raise AdapterInvalid(
            f"module {saved}: {len(wrappers)} nested LoRA(s) on its stacked parameters, but the config's "
            f"target_parameters target {len(targeted)} of them ({', '.join(targeted) or 'none'})")
    experts = sum(1 for name in base if name.startswith(f"{module}.") and name.endswith(".down_proj"))
    slices: dict[str, ExpertSlice] = {}
    for (a_key, b_key), parameter in zip(wrappers, reversed(targeted)):  # the last targeted is the outermost
        projections = STACKED_PARAMETERS[parameter]
        in_features = base[f"{module}.0.{projections[0]}"][0]
        widths = [base[f"{module}.0.{p}"][1] for p in projections]
        r = rank(f"{saved}.{parameter}")
        for key, want in ((a_key, (experts * r, in_features)), (b_key, (sum(widths), experts * r))):
            if tuple(shape(key)) != want:
                raise AdapterInvalid(
                    f"tensor {key} has shape {list(shape(key))}; expected {list(want)} (a LoRA on the stacked "
                    f"{parameter} of {experts} experts, rank {r} from adapter_config.json)")
        for expert in range(experts):
            start = 0
            for projection, width in zip(projections, widths):
                slices[f"{module}.{expert}.{projection}"] = ExpertSlice(
                    f"{saved}.{parameter}", a_key, b_key, (slice(expert * r, (expert + 1) * r),),
                    (slice(start, start + width), slice(expert, None, experts)))
                start += width
    return slices
