"""vLLM's utility routes' bodies (server/vllm_routes.py)."""

from __future__ import annotations

from pydantic import Field

from loraplex.protocol.base import RequestModel

# A static ceiling on /detokenize's list, past any model's context: its validation stops at the first id past it
# (the route then bounds the list by the model's --max-total-tokens, server/vllm_routes.py).
DETOKENIZE_MAX_TOKENS = 1 << 21


class DetokenizeRequest(RequestModel):
    model: str | None = None  # a served name or adapter (vLLM checks it); the text is the base tokenizer's
    tokens: list[int] = Field(max_length=DETOKENIZE_MAX_TOKENS)
