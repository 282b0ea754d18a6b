"""Maps a model_type to its family: the model class and the normaliser of its config.json."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from torch import nn

from loraplex.models.config import ModelConfig
from loraplex.models.bart import BartForConditionalGeneration, bart_config_from_hf
from loraplex.models.hf_config import normalised
from loraplex.models.llama import LLAMA_FAMILY, LlamaForCausalLM, llama_config_from_hf
from loraplex.models.llava_next import (
    LlavaNextForConditionalGeneration, llava_config_from_hf, llava_next_config_from_hf,
)
from loraplex.models.mllama import MllamaForConditionalGeneration, mllama_config_from_hf
from loraplex.models.mpt import MptForCausalLM, mpt_config_from_hf
from loraplex.models.t5 import T5ForConditionalGeneration, t5_config_from_hf


class Family(NamedTuple):
    model_class: type[nn.Module]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]


_LLAMA = Family(LlamaForCausalLM, llama_config_from_hf)
_T5 = Family(T5ForConditionalGeneration, t5_config_from_hf)
_BART = Family(BartForConditionalGeneration, bart_config_from_hf)
# In the order an unsupported model_type's error lists them.
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(LLAMA_FAMILY, _LLAMA),
    "llava": Family(LlavaNextForConditionalGeneration, llava_config_from_hf),  # LLaVA 1.5: one tile per image
    "llava_next": Family(LlavaNextForConditionalGeneration, llava_next_config_from_hf),
    "mllama": Family(MllamaForConditionalGeneration, mllama_config_from_hf),
    "mpt": Family(MptForCausalLM, mpt_config_from_hf),
    "t5": _T5,
    "mt5": _T5,
    "bart": _BART,
    "mbart": _BART,
}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A config.json (as a dict) -> our ModelConfig: where Hugging Face config quirks stop, every family's
    config (old and new transformers spellings alike) becoming one flat, frozen description.
    Raises ValueError naming what the config lacks, holds wrongly typed, or what we do not serve."""
    return normalised(_family_config, hf)


def _family_config(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return family.config_from_hf(hf)


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return FAMILIES[config.model_type].model_class
    except KeyError:
        raise ValueError(f"no model for model_type {config.model_type!r}") from None
