"""Maps a normalised config to its model class."""

from __future__ import annotations

from torch import nn

from loraplex.config import ModelConfig
from loraplex.models.bart import BartForConditionalGeneration
from loraplex.models.llama import LlamaForCausalLM
from loraplex.models.llava_next import LlavaNextForConditionalGeneration
from loraplex.models.mllama import MllamaForConditionalGeneration
from loraplex.models.mpt import MptForCausalLM
from loraplex.models.t5 import T5ForConditionalGeneration

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "llava_next": LlavaNextForConditionalGeneration,
    "mllama": MllamaForConditionalGeneration,
    "mpt": MptForCausalLM,
    "t5": T5ForConditionalGeneration,
    "mt5": T5ForConditionalGeneration,
    "bart": BartForConditionalGeneration,
    "mbart": BartForConditionalGeneration,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise ValueError(f"no model for model_type {config.model_type!r}") from None
