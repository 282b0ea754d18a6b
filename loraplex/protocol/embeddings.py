"""Embedding requests and answers: OpenAI's `POST /v1/embeddings` and LoRAX's `POST /embed`.

OpenAI's `input` is one text, a list of texts, one list of token ids, or a list of such lists; `encoding_format`
`float` (a list of numbers) or `base64` (the float32 values' little-endian bytes); `dimensions` keeps the first N
values and normalises them again (Matryoshka-style, as OpenAI's text-embedding-3 does). LoRAX's body is one text and
its adapter `parameters`; its answer `{"embeddings": [...]}` is that text's vector.
"""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel, Field

from loraplex.protocol.base import RequestModel
from loraplex.protocol.native import MergedAdapters


class EmbeddingRequest(RequestModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # LoRAX's extras, as on its OpenAI routes: another way to name the adapter, its source, a hub token.
    adapter_id: str | None = None
    adapter_source: str | None = None
    api_token: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text, or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(item, int) for item in value):
            return [list(value)]
        return list(value)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as the request asked: numbers, or base64 of its float32 little-endian bytes (OpenAI's)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbedParameters(RequestModel):
    adapter_id: str | None = None
    adapter_source: str | None = None
    merged_adapters: MergedAdapters | None = None
    api_token: str | None = None


class EmbedRequest(RequestModel):
    """LoRAX's `/embed` body."""

    inputs: str
    parameters: EmbedParameters = Field(default_factory=EmbedParameters)


class EmbedResponse(BaseModel):
    embeddings: list[float]
