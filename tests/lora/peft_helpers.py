"""PEFT as the reference for LoRA tests: adapters with random weights on a copy of a transformers model,
saved as PEFT saves them, and PEFT's own greedy tokens and logits.

PEFT injects its layers into the model it is given, so `peft_model` always works on a deep copy: the
transformers model passed in (often a session-shared fixture) is never modified.
"""

from __future__ import annotations

import copy
import math
import pathlib

import torch

from loraplex.lora.adapter import LoraAdapter, load_adapter_dir

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(hf_model, seed: int, strength: float = 0.5, **lora_kwargs):
    """A PEFT LoRA model (adapter "default") over a deep copy of `hf_model`, with random A and B.

    Each module's B is drawn so that its delta `scale * B @ A @ x` has about `strength` times the rms of
    `x` per output, whatever the rank and scale: the adapter changes the output visibly in every case.
    PEFT's own scale (its `scaling`) is used only to size B; ours is computed from adapter_config.json,
    so an error in it still shows.
    """
    import peft

    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    _randomize(model, "default", seed, strength)
    return model.eval()


def add_random_adapter(model, name: str, seed: int, strength: float = 0.5, **lora_kwargs) -> None:
    """Add a second (third, ...) random adapter to a PEFT model; `model.set_adapter(name)` selects it."""
    import peft

    model.add_adapter(name, peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    _randomize(model, name, seed, strength)


def _randomize(model, name: str, seed: int, strength: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    layers = lora_layers(model, name)
    assert layers, f"PEFT put no LoRA {name!r} on the model"
    with torch.no_grad():
        for layer in layers.values():
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            rank, in_features = a.shape
            a.copy_(torch.randn(a.shape, generator=generator) / math.sqrt(in_features))
            b.copy_(torch.randn(b.shape, generator=generator) * strength / (math.sqrt(rank) * layer.scaling[name]))


def lora_layers(model, name: str = "default") -> dict:
    """PEFT's LoRA layers carrying adapter `name`, by module name in the base model."""
    from peft.tuners.lora import LoraLayer

    return {
        module_name.removeprefix("base_model.model."): m
        for module_name, m in model.named_modules()
        if isinstance(m, LoraLayer) and name in m.lora_A
    }


def save_and_load(
    model, directory: pathlib.Path, adapter_id: str, base_shapes, max_rank: int = 64, base_weight=None,
    name: str = "default",
) -> LoraAdapter:
    """Save adapter `name` with PEFT's `save_pretrained` (safetensors), then read it with our loader."""
    model.save_pretrained(str(directory), selected_adapters=[name])
    saved = directory if name == "default" else directory / name  # where PEFT puts a named adapter
    return load_adapter_dir(saved, adapter_id, base_shapes, max_rank, base_weight)


def peft_from_dir(hf_model, directory: pathlib.Path):
    """PEFT's own reading of a saved adapter directory, over a deep copy of `hf_model`.

    The reference for what a file means: PEFT writes adapter_config.json with sorted keys, so when
    rank_pattern / alpha_pattern keys overlap, the first match after reloading may differ from the first
    match of the model that was saved.
    """
    import peft

    return peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(directory)).eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' `generate` (EOS not a stop, as with ignore_eos)."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
    )[0, len(prompt):].tolist()
    assert len(out) == max_new_tokens, f"generate stopped early: {out}"
    return out


@torch.inference_mode()
def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of `prompt` [T, vocab], float32."""
    return model(torch.tensor([prompt])).logits[0].float()


@torch.inference_mode()
def reference_step_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The logits each generated token was chosen from [len(generated), vocab], in one forward pass."""
    ids = prompt + generated[:-1]
    return model(torch.tensor([ids])).logits[0, len(prompt) - 1 :].float()


def relayout_adapter(source: pathlib.Path, dest: pathlib.Path, renames: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """A copy of the saved adapter `source` in `dest` whose tensor names have each (old, new) prefix replaced:
    the adapter as PEFT would have saved it on another layout of the same model (transformers 4's). Returns the
    renamed tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = {}
    for key, tensor in load_file(str(source / "adapter_model.safetensors")).items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old):]
        tensors[key] = tensor
    shutil.copytree(source, dest)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return tensors
