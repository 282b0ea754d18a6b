"""Model weights: read the safetensors of a model directory (a `ModelSource`) and load them into our modules.

Pickled checkpoints (`.bin`, `.pt`) are refused: we never unpickle.

`load_into` is the strict loader every model uses: every parameter and persistent buffer must be
filled, every checkpoint tensor used or explicitly ignored, every shape must match.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from loraplex.checkpoints.json_files import JsonFileError, read_json_object
from loraplex.checkpoints.safetensors_header import SafetensorsHeaderError, TensorHeader, read_header

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class WeightsError(RuntimeError):
    """A model could not be found, converted or loaded; the message says what and why."""


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to an HF-format directory on local disk."""

    model_id: str  # what the user asked for (sources.DEFAULT_MODEL_ID for the embedded default)
    path: pathlib.Path  # config.json, *.safetensors (one, or shards + model.safetensors.index.json), tokenizer
    hf_config: dict  # parsed config.json


MAX_JSON_BYTES = 16 << 20  # config.json is kilobytes; a shard index of many thousand tensors a few megabytes


def read_json(file: pathlib.Path, name: str) -> dict[str, Any]:
    """A model's JSON file (config.json, the shard index, generation_config.json) as a dict, bounded in size;
    anything else is a WeightsError naming the file."""
    try:
        return read_json_object(file, MAX_JSON_BYTES)
    except JsonFileError as exc:
        raise WeightsError(f"{name}: cannot read {file.name}: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Reading safetensors


def safetensors_files(path: pathlib.Path, model_id: str | None = None) -> list[pathlib.Path]:
    """The safetensors files of a model directory: the index's shards, else model.safetensors, else all."""
    name = model_id or str(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, name).get("weight_map")
        shards = weight_map.values() if isinstance(weight_map, dict) else [None]
        if not all(isinstance(f, str) and f == pathlib.Path(f).name and f.endswith(".safetensors") for f in shards):
            # a name like "../x" or "/etc/x" would read a file outside the model's directory
            raise WeightsError(f"{name}: {index.name}: weight_map must map tensor names to .safetensors files in the directory")
        files = [path / f for f in sorted(set(shards))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{name}: shards listed in {index.name} are missing: {', '.join(missing[:10])}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise WeightsError(
            f"{name}: only pickled weights ({', '.join(pickled[:5])}); loraplex never unpickles checkpoints. "
            "Convert them to safetensors first."
        )
    raise WeightsError(f"{name}: no *.safetensors weights in {path}")


def load_state_dict(
    source: ModelSource | str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    show_progress: bool = False, keep_float32: Callable[[str], bool] | None = None,
    keep_stored: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a model's safetensors (sharded or not), on `device`; floating tensors cast to `dtype`
    (those `keep_float32` names, to float32; those `keep_stored` names, a quantized checkpoint's own tensors, not).

    `show_progress` draws a progress bar over the tensors on stderr (the server's start-up).
    """
    from safetensors import safe_open
    from tqdm import tqdm

    path = source.path if isinstance(source, ModelSource) else pathlib.Path(source)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    files = safetensors_files(path)
    total = sum(len(checked_header(file)) for file in files)  # every header checked before any tensor is read
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not show_progress, file=sys.stderr)
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                bar.update()
                if key in state:
                    raise WeightsError(f"tensor {key!r} appears in both {origin[key]} and {file.name}")
                tensor = f.get_tensor(key)
                target = torch.float32 if keep_float32 is not None and keep_float32(key) else dtype
                if keep_stored is not None and keep_stored(key):
                    target = None
                if target is not None and tensor.is_floating_point() and tensor.dtype != target:
                    tensor = tensor.to(target)
                state[key] = tensor
                origin[key] = file.name
    bar.close()
    return state


def checked_header(file: pathlib.Path) -> dict[str, TensorHeader]:
    """The tensors a safetensors file holds, its header checked (`safetensors_header`): a lying one is a WeightsError."""
    try:
        return read_header(file)
    except SafetensorsHeaderError as exc:
        raise WeightsError(f"{file.name} is not a valid safetensors file: {exc}") from exc
    except OSError as exc:
        raise WeightsError(f"{file.name} cannot be read: {exc.strerror}") from exc


# --------------------------------------------------------------------------------------------------
# Strict loading into a module


def load_into(
    module: torch.nn.Module,
    state: dict[str, torch.Tensor],
    ignore: Iterable[str] = (),
    ignore_patterns: Iterable[str | re.Pattern] = (),
) -> None:
    """Fill every parameter and persistent buffer of `module` from `state` (by state_dict name).

    Works on modules built on the `meta` device: tensors are assigned, not copied, so they keep the
    checkpoint's dtype and device (convert with `load_state_dict(dtype=...)`). Tied parameters (one
    tensor object under several names, e.g. lm_head.weight and model.embed_tokens.weight) are filled
    from whichever of their names the checkpoint has; if it has several, they must be equal.
    A checkpoint tensor that is not used raises, unless its name is in `ignore` or matches (re.search)
    one of `ignore_patterns`. Missing tensors and shape mismatches raise too, naming the tensors.
    Non-persistent buffers are left as the module built them.
    A module with a `checkpoint_name(name) -> name` method (a family whose checkpoints come in several
    layouts, e.g. LLaVA-NeXT saved by transformers 4) has checkpoint names mapped through it first; one with a
    `joined_checkpoint_tensors(state) -> state` method (a family holding as one tensor what checkpoints may hold as
    several: Mixtral's experts, stacked) then joins them (`renamed_state`).
    """
    state = renamed_state(module, state)
    # Group the module's names by tensor object: tied weights share one group.
    groups: dict[int, list[str]] = {}
    targets: dict[int, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
        targets[id(tensor)] = tensor

    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    plan: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []
    for key, names in groups.items():
        target = targets[key]
        present = [n for n in names if n in state]
        used.update(present)
        if not present:
            missing.append(names[0] if len(names) == 1 else f"{names[0]} (tied with {', '.join(names[1:])})")
            continue
        for n in present:
            if tuple(state[n].shape) != tuple(target.shape):
                mismatched.append(f"{n}: checkpoint {tuple(state[n].shape)} vs module {tuple(target.shape)}")
        first = state[present[0]]
        for other in present[1:]:
            if state[other].shape == first.shape and not torch.equal(state[other].to(first.device), first):
                raise WeightsError(
                    f"{present[0]} and {other} are tied in the module but differ in the checkpoint"
                )
        plan.append((names, target, first))

    ignore_set = set(ignore)
    patterns = [re.compile(p) if isinstance(p, str) else p for p in ignore_patterns]
    unexpected = sorted(
        k for k in state if k not in used and k not in ignore_set and not any(p.search(k) for p in patterns)
    )

    problems = []
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (not used by the model): {_few(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} with the wrong shape: {_few(mismatched)}")
    if problems:
        raise WeightsError(f"cannot load weights into {type(module).__name__}: " + "; ".join(problems))

    for names, target, tensor in plan:
        if isinstance(target, torch.nn.Parameter):
            value: torch.Tensor = torch.nn.Parameter(tensor, requires_grad=target.requires_grad)
        else:
            value = tensor
        for name in names:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if leaf in owner._parameters:
                owner._parameters[leaf] = value  # type: ignore[assignment]
            elif leaf in owner._buffers:
                owner._buffers[leaf] = value
            else:  # a custom state_dict name we cannot map to a tensor attribute
                raise WeightsError(f"{name}: not a parameter or buffer of {type(owner).__name__}")


def renamed_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under `module`'s own names (its `checkpoint_name` mapping and `joined_checkpoint_tensors`, if it
    has them; see `load_into`). Idempotent: a renamed state stays as it is."""
    rename = getattr(module, "checkpoint_name", None)
    state = _renamed(state, rename) if callable(rename) else dict(state)
    join = getattr(module, "joined_checkpoint_tensors", None)
    if callable(join):
        try:
            state = join(state)
        except ValueError as exc:
            raise WeightsError(f"cannot load weights into {type(module).__name__}: {exc}") from exc
    return state


def _renamed(state: dict[str, torch.Tensor], rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    renamed: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, tensor in state.items():
        name = rename(key)
        if name in renamed:
            raise WeightsError(f"checkpoint tensors {origin[name]!r} and {key!r} both fill {name!r}")
        renamed[name], origin[name] = tensor, key
    return renamed


def _few(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
