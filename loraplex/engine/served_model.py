"""What the server knows of the model the engine serves: fixed when the engine is built, read from any thread.

The server holds the `AsyncEngine` and reads this description and the engine's stats snapshot (stats.py),
never the engine's parts. With tensor parallelism this is what rank 0 presents for the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.checkpoints.pooling_config import EmbeddingPooling
from loraplex.config import EngineConfig
from loraplex.engine.requests.inputs import InputLimits
from loraplex.engine.stats import AdapterTargets


@dataclass(frozen=True)
class ServedModel:
    model_id: str
    model_type: str  # the checkpoint's config.json model_type
    tokenizer: Any  # loraplex.tokenizer.Tokenizer: encoding, chat templates, detokenizing
    processor: Any | None  # the model's Hugging Face processor (images); None for text-only models
    device_type: str  # "cpu", "cuda"
    dtype: str  # the weights' and activations' dtype, e.g. "bfloat16"
    kv_cache_dtype: str  # "float8_e4m3fn" under --kv-cache-dtype fp8
    limits: InputLimits  # max input length, max total tokens, takes images, encoder-decoder
    kv_capacity_tokens: int  # token slots in the KV cache
    bos_token_id: int | None
    sampling_defaults: tuple[tuple[str, float], ...]  # generation_config.json's, for the OpenAI routes
    settings: EngineConfig  # the engine's settings, as fitted to the model
    adapter_targets: AdapterTargets  # what an adapter store needs of the base model
    pooling: EmbeddingPooling = EmbeddingPooling()  # how its embeddings are made (the embedding routes read it)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.limits.is_encoder_decoder

    @property
    def takes_images(self) -> bool:
        return self.limits.takes_images

    @property
    def max_input_length(self) -> int:
        return self.limits.max_input_length

    @property
    def max_total_tokens(self) -> int:
        return self.limits.max_total_tokens
