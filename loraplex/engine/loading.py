"""Builds a ready-to-run model from an EngineConfig: resolve the source, build on meta, load weights."""

from __future__ import annotations

import logging
import pathlib
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from loraplex.checkpoints.pooling_config import EmbeddingPooling, read_pooling
from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import ModelSource, load_into, load_state_dict, read_json, renamed_state
from loraplex.config import EngineConfig
from loraplex.models.config import SAMPLING_DEFAULT_FIELDS, ModelConfig
import loraplex.example_models  # noqa: F401  (registers the example models' ids with resolve_model)
from loraplex.models.hf_config import token_id, token_ids
from loraplex.models.registry import config_from_hf, model_class
from loraplex.quantization import (
    QuantizationError, check_quantize, move_unquantized, quantize_model, weight_bytes,
)
from loraplex.quantization.checkpoint_format import (
    CheckpointFormat, checkpoint_format, kv_cache_scales, replace_quantized_linears,
)
from loraplex.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger("loraplex.loading")


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
    # A quantized checkpoint's calibrated KV-cache scales, {layer index: (k_scale, v_scale)}: an FP8 cache uses them.
    kv_scales: dict | None = None
    # How its embeddings are made (checkpoints/pooling_config.py: the sentence-transformers files; None: the default).
    pooling: EmbeddingPooling | None = None


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


def build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], quantized: CheckpointFormat | None = None,
    device: torch.device | None = None, dtype: torch.dtype | None = None,
) -> nn.Module:
    """Our model for `config`, built on the meta device and filled from `state` (every weight used).

    From a pre-quantized checkpoint (`quantized`: its format), the quantized linears are built first, on `device`
    computing in `dtype`, from their own tensors; the strict loader then fills the rest.

    A config that ties the head to the embedding while the checkpoint holds a different head gets its own
    head, as transformers does (transformers 5 saves T5 v1.1 / Flan-T5 with `tie_word_embeddings: true`). Where
    else a family's config and its file disagree, the model is built as transformers builds it
    (`config_for_checkpoint`), with a warning.
    """
    config, changed = model_class(config).config_for_checkpoint(config, set(state))
    if changed is not None:
        logger.warning(changed)
    with torch.device("meta"):
        model = model_class(config)(config)
    if config.tie_word_embeddings and _head_differs_in(state, model):
        with torch.device("meta"):
            model = model_class(config)(replace(config, tie_word_embeddings=False))
    # A family may name tensors its checkpoints can lack (zeros then, as transformers initialises BART's
    # final_logits_bias) and ones they can hold that it does not use (fairseq's `version`).
    for name in model.optional_checkpoint_tensors:
        if name not in state:
            like = model.get_buffer(name) if name in dict(model.named_buffers()) else model.get_parameter(name)
            weights = next(t for t in state.values() if t.is_floating_point())  # the loaded dtype and device
            state = {**state, name: torch.zeros(like.shape, dtype=weights.dtype, device=weights.device)}
    ignored = model.unused_checkpoint_tensors
    if quantized is not None:
        state = renamed_state(model, state)
        replace_quantized_linears(model, state, quantized, device, dtype)
        ignored = (*ignored, *quantized.ignored)
    load_into(model, state, ignore_patterns=ignored)
    return model.eval()


def _head_differs_in(state: dict[str, torch.Tensor], model: nn.Module) -> bool:
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if head is None:
        return False
    by_name = {model.checkpoint_name(key): key for key in state}
    tied = [state[by_name[n]] for n, t in model.state_dict(keep_vars=True).items() if t is head and n in by_name]
    return any(t.shape != tied[0].shape or not torch.equal(t, tied[0]) for t in tied[1:])


def float32_names(config: ModelConfig, dtype: torch.dtype):
    """Which checkpoint tensors stay float32 in half precision (the family's `keep_in_float32` modules,
    as transformers keeps T5's `wo`); None when nothing does."""
    keep = model_class(config).keep_in_float32
    if not keep or dtype not in (torch.float16, torch.bfloat16):
        return None
    return lambda name: any(part in keep for part in name.split(".")[:-1])


def load_model(
    config: EngineConfig, log=lambda msg: print(msg, file=sys.stderr, flush=True), show_progress: bool = False
) -> LoadedModel:
    started = time.perf_counter()
    source: ModelSource = resolve_model(config.model_id, progress=log, revision=config.revision)
    model_config = with_generation_config(config_from_hf(source.hf_config), _generation_config(source))
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    quantize = getattr(config, "quantize", None)
    published = checkpoint_format(source.hf_config)  # refused before any weight is read, as is --quantize
    if published is not None and quantize:
        raise QuantizationError(f"{source.model_id} is already quantized ({published.name}): drop --quantize {quantize}")
    if quantize:
        check_quantize(quantize, device, dtype)
    log(f"loading {source.model_id} ({model_config.num_layers} layers) on {device} as {str(dtype).removeprefix('torch.')}")
    # Quantizing for a GPU: the float weights stay in host memory and each linear reaches the GPU quantized,
    # so the GPU never holds the float model (its peak is the quantized one plus the largest linear).
    staging = torch.device("cpu") if quantize and device.type != "cpu" else device
    state = load_state_dict(
        source, device=str(staging), dtype=dtype, show_progress=show_progress,
        keep_float32=float32_names(model_config, dtype),
        keep_stored=published.keeps_stored_dtype if published is not None else None,
    )
    kv_scales = kv_cache_scales(state) if published is not None else {}
    model = build_model(model_config, state, published, device, dtype)
    if published is not None:
        log(f"read {published.name} weights; they take {weight_bytes(model) / 2**30:.2f} GiB")
    if quantize:
        del state  # the float weights go as their linears are replaced
        replaced = quantize_model(model, quantize, device, dtype)
        move_unquantized(model, device)
        log(f"quantized {replaced} linears ({quantize}); weights take {weight_bytes(model) / 2**30:.2f} GiB")
    tokenizer = Tokenizer.from_pretrained(str(source.path), extra_eos_ids=_generation_eos_ids(source, model_config))
    if config.chat_template:
        tokenizer.hf.chat_template = pathlib.Path(config.chat_template).read_text()
    takes_images = model_config.vision is not None or model_config.mllama is not None
    processor = _processor(source) if takes_images else None
    pooling = read_pooling(source.path, model_config.encoder_decoder is not None)
    log(f"model loaded in {time.perf_counter() - started:.1f}s")
    return LoadedModel(model, model_config, tokenizer, device, dtype, source.model_id, processor, kv_scales or None,
                       pooling)


def _processor(source: ModelSource):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(source.path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source.model_id} takes images but has no usable processor files ({exc})") from exc


def _generation_config(source: ModelSource) -> dict[str, Any]:
    path = source.path / "generation_config.json"
    return read_json(path, source.model_id) if path.exists() else {}


def with_generation_config(config: ModelConfig, generation: dict[str, Any]) -> ModelConfig:
    """`config` with the generation config's sampling values (ModelConfig.sampling_defaults: the numbers it sets;
    the server checks their ranges) and, for an encoder-decoder, its decoder start and forced tokens (which win over
    config.json's, as in transformers)."""
    defaults = tuple((name, generation[name]) for name in SAMPLING_DEFAULT_FIELDS
                     if isinstance(generation.get(name), (int, float)) and not isinstance(generation[name], bool))
    config = replace(config, sampling_defaults=defaults) if defaults else config
    encdec = config.encoder_decoder
    if encdec is None:
        return config
    vocab, found = config.vocab_size, {}
    where = "generation_config.json: "
    if generation.get("decoder_start_token_id") is not None:
        found["decoder_start_token_id"] = token_id(where + "decoder_start_token_id", generation["decoder_start_token_id"], vocab)
    if "forced_bos_token_id" in generation:
        found["forced_bos_token_id"] = token_id(where + "forced_bos_token_id", generation["forced_bos_token_id"], vocab)
    if "forced_eos_token_id" in generation:
        found["forced_eos_token_ids"] = token_ids(where + "forced_eos_token_id", generation["forced_eos_token_id"], vocab)
    return replace(config, encoder_decoder=replace(encdec, **found)) if found else config


def _generation_eos_ids(source: ModelSource, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from the model config and generation_config.json (Llama 3 lists several)."""
    ids = set(config.eos_token_ids)
    ids.update(token_ids("generation_config.json: eos_token_id", _generation_config(source).get("eos_token_id"),
                         config.vocab_size))
    return tuple(sorted(ids))
