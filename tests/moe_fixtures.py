"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE) with a transformers twin, their checkpoints in both
expert layouts, and the reference for expert LoRA: the transformers model with each delta merged into its weights."""

from __future__ import annotations

import copy
import json
import pathlib

import torch
from safetensors.torch import save_file

from tests.helpers import tiny_hf_model

# Qwen2-MoE: a shared expert, and layer 1 dense (mlp_only_layers).
MOE_KINDS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, mlp_only_layers=[1], num_hidden_layers=3),
}


def tiny_moe(kind: str, seed: int = 0, **overrides):
    """A random transformers MixtralForCausalLM / Qwen2MoeForCausalLM (float32, hidden 64), its weights drawn
    wide enough that the router's choices and the experts matter."""
    model = tiny_hf_model(kind, seed=seed, **{**MOE_KINDS[kind], **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 2.0 / p.shape[-1] ** 0.5)
            elif "experts" in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return model


def save_stacked(hf, path: pathlib.Path) -> dict[str, torch.Tensor]:
    """`hf` written with its experts stacked, as its modules hold them (`...experts.gate_up_proj`), next to its
    config; returns the tensors. (transformers 5.25's save_pretrained writes them one by one instead.)"""
    path.mkdir(parents=True, exist_ok=True)
    hf.config.to_json_file(str(path / "config.json"))
    tensors = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


# Our per-expert module names -> Mixtral's hub (and PEFT's) names.
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def hub_module_name(kind: str, module: str) -> str:
    """Our module name as a hub checkpoint (and so PEFT, on the per-expert layout) names it."""
    if kind != "mixtral" or ".mlp." not in module:
        return module
    parts = module.replace(".mlp.", ".block_sparse_moe.").split(".")
    if "experts" in parts and parts[-1] in _MIXTRAL:
        parts[-1] = _MIXTRAL[parts[-1]]
    return ".".join(parts)


def write_peft_adapter(kind: str, path: pathlib.Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       config: dict) -> None:
    """An adapter directory as PEFT saves one on the per-expert layout: `modules` (our name -> (A, B))."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in modules.items():
        saved = "base_model.model." + hub_module_name(kind, module)
        tensors[f"{saved}.lora_A.weight"], tensors[f"{saved}.lora_B.weight"] = a.contiguous(), b.contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "bias": "none", **config}))


def merged(hf, deltas: dict[str, torch.Tensor]):
    """A copy of `hf` with each delta [out, in] (our module name -> scale * B @ A) added to its weight: the stacked
    experts' rows for an expert's projection, a linear's (or the router's) weight for the rest."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for module, delta in deltas.items():
            parts = module.split(".")
            if "experts" in parts:
                experts, expert, projection = model.get_submodule(".".join(parts[:-2])), int(parts[-2]), parts[-1]
                size = experts.intermediate_dim
                if projection == "down_proj":
                    experts.down_proj[expert] += delta
                else:
                    half = ("gate_proj", "up_proj").index(projection)
                    experts.gate_up_proj[expert, half * size:(half + 1) * size] += delta
            else:
                model.get_submodule(module).weight += delta
    return model
