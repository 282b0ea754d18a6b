"""vLLM's utility routes' bodies (server/vllm_routes.py)."""

from __future__ import annotations

from loraplex.protocol.base import RequestModel


class DetokenizeRequest(RequestModel):
    model: str | None = None  # a served name or adapter (vLLM checks it); the text is the base tokenizer's
    tokens: list[int]
