"""The mixture-of-experts members of the Llama family, Mixtral and Qwen2-MoE (Qwen1.5-MoE): their config fields, and
their checkpoints' two layouts of the experts.

Hub checkpoints (and transformers 5's `save_pretrained`, which writes them back so) name each expert's linears:
Mixtral `model.layers.N.block_sparse_moe.experts.E.w1|w2|w3.weight` and `...block_sparse_moe.gate.weight`,
Qwen2-MoE `model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj.weight`. transformers 5's own modules (its
`state_dict`) hold them stacked: `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] and `...experts.down_proj`
[E, H, I], as ours do (layers/moe.py). `checkpoint_name` maps Mixtral's names onto Qwen2-MoE's (w1 is the gate,
w3 the up, w2 the down projection), which are ours per expert; `stack_experts` stacks the per-expert tensors.
PEFT names an adapter's per-expert LoRA by the per-expert names, so adapters map through the same renames.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from loraplex.layers.moe import MoeSettings
from loraplex.models.hf_config import require

MOE_TYPES = ("mixtral", "qwen2_moe")

_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w1(\.|$)"), r"\1.gate_proj\2"),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w3(\.|$)"), r"\1.up_proj\2"),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w2(\.|$)"), r"\1.down_proj\2"),
)


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's (or PEFT module's) name under our modules' names, per expert where it names one."""
    if "block_sparse_moe" in name or ".experts." in name:
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
    return name


def moe_from_hf(hf: dict[str, Any], num_layers: int) -> MoeSettings | None:
    """The MoE settings of a Mixtral or Qwen2-MoE config.json (None for the rest of the family)."""
    model_type = hf.get("model_type")
    if model_type not in MOE_TYPES:
        return None
    mixtral = model_type == "mixtral"
    num_experts = hf.get("num_local_experts", hf.get("num_experts", 8)) if mixtral else hf.get("num_experts", 60)
    top_k = hf.get("num_experts_per_tok", 2 if mixtral else 4)
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if any(sparse):
        require("num_experts_per_tok", top_k, top_k <= num_experts, f"more than the {num_experts} experts")
    shared = 0 if mixtral else hf.get("shared_expert_intermediate_size", 5632)
    return MoeSettings(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=hf["intermediate_size"] if mixtral else hf.get("moe_intermediate_size", 1408),
        renormalize=mixtral or bool(hf.get("norm_topk_prob", False)),
        weights_in_model_dtype=not mixtral,
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
    )


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_experts(state: dict[str, torch.Tensor], experts: Iterable[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """`state` (our names) with each experts module's per-expert tensors (`P.E.gate_proj.weight` ...) stacked
    into its `P.gate_up_proj` and `P.down_proj`; `experts`: (module name P, number of experts). Raises ValueError
    when a module's experts are there in part, or in both layouts."""
    state = dict(state)
    for prefix, count in experts:
        keys = {(e, p): f"{prefix}.{e}.{p}.weight" for e in range(count) for p in _PROJECTIONS}
        present = [k for k in keys.values() if k in state]
        if not present:
            continue
        if len(present) < len(keys):
            missing = [k for k in keys.values() if k not in state]
            raise ValueError(f"{prefix}: the checkpoint holds {len(present)} of its {len(keys)} per-expert tensors; "
                             f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        stacked = [f"{prefix}.gate_up_proj", f"{prefix}.down_proj"]
        if any(k in state for k in stacked):
            raise ValueError(f"{prefix}: the checkpoint holds its experts both stacked and one by one")
        state[stacked[0]] = _stacked([torch.cat([state.pop(keys[e, "gate_proj"]), state.pop(keys[e, "up_proj"])])
                                      for e in range(count)])
        state[stacked[1]] = _stacked([state.pop(keys[e, "down_proj"]) for e in range(count)])
    return state


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len({(t.shape, t.dtype) for t in tensors}) != 1:
        raise ValueError(f"experts of different shapes or dtypes: {sorted({(tuple(t.shape), str(t.dtype)) for t in tensors})}")
    return torch.stack(tensors)
