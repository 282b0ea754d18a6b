"""Builds a ready-to-run model from an EngineConfig: resolve the source, build on meta, load weights."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loraplex.config import EngineConfig, ModelConfig
from loraplex.models.registry import model_class
from loraplex.tokenizer import Tokenizer
from loraplex.weights import ModelSource, load_into, load_state_dict, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    model_id: str
    # The model's Hugging Face processor (image resizing, tiling, placeholder expansion) when it
    # takes images; None for text-only models.
    processor: Any = None


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_model(config: ModelConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    """Our model for `config`, built on the meta device and filled from `state` (every weight used)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    load_into(model, state)
    return model.eval()


def load_model(
    config: EngineConfig, log=lambda msg: print(msg, file=sys.stderr, flush=True), show_progress: bool = False
) -> LoadedModel:
    started = time.perf_counter()
    source: ModelSource = resolve_model(config.model_id)
    model_config = ModelConfig.from_hf(source.hf_config)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    log(f"loading {source.model_id} ({model_config.num_layers} layers) on {device} as {str(dtype).removeprefix('torch.')}")
    state = load_state_dict(source, device=str(device), dtype=dtype, show_progress=show_progress)
    model = build_model(model_config, state)
    tokenizer = Tokenizer.from_pretrained(str(source.path), extra_eos_ids=_generation_eos_ids(source, model_config))
    if config.chat_template:
        tokenizer.hf.chat_template = pathlib.Path(config.chat_template).read_text()
    processor = _processor(source) if model_config.vision is not None else None
    log(f"model loaded in {time.perf_counter() - started:.1f}s")
    return LoadedModel(model, model_config, tokenizer, device, dtype, source.model_id, processor)


def _processor(source: ModelSource):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(source.path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source.model_id} takes images but has no usable processor files ({exc})") from exc


def _generation_eos_ids(source: ModelSource, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from the model config and generation_config.json (Llama 3 lists several)."""
    ids = set(config.eos_token_ids)
    path = source.path / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))
