"""Per-request state that lives across engine steps. Pure Python (the scheduler imports it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from loraplex.params import FinishReason, PromptScore, SamplingParams


class RequestRefused(ValueError):
    """The engine cannot serve this request as asked (too long, empty, ...). The message says why."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the effective seed (params.seed, or one the engine picked)
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose keys/values are in the KV cache. A decoding request has exactly one more token
    # (the last sampled) than it has computed.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Filled once by the first prefill that covers the prompt (never recomputed after preemption).
    prompt_logprobs: list[PromptScore | None] | None = None
    first_scheduled_time: float | None = None
    adapter_key: str | None = None  # the store's key of its adapter (LoraAdapter.key); None: the base model
    adapter_slot: int | None = None  # the device slot of its adapter, while running
    # Its images (a multimodal.image_inputs.ImageInputs), already expanded into placeholder tokens in prompt_ids;
    # the scheduler only ever sees the token counts.
    images: Any = None
    # Encoder-decoder models: the encoder's input (what the client sent; `prompt_ids` is then the decoder's
    # start, [decoder_start_token_id]), and the KV blocks holding its cross-attention states while running.
    # The encoder (or a vision model's image encoder) runs at the request's first step after each
    # admission (see `states_ready`).
    encoder_ids: list[int] | None = None
    cross_block_ids: list[int] = field(default_factory=list)
    # States its cross-attention layers read (an encoder's output rows, one per encoder token; a vision
    # model's image states, set by the engine, which knows the model; 0: none), kept in `cross_block_ids`
    # while it runs.
    num_states: int = 0
    # Whether its cross-attention states are in `cross_block_ids` (made at its first step after admission).
    states_ready: bool = False
    # Structured output: the request's grammar matcher (engine/requests/grammars.py), fed each generated token.
    grammar: Any = None
    # Prefix caching (engine.prefix_cache): the root of its blocks' hash chain (None: never cached), the digest
    # of its images, its full blocks' hashes as far as computed, and how many of its `block_ids` (from the
    # first) are registered in the cache or taken from it.
    cache_key: bytes | None = None
    image_digest: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Speculative decoding: tokens guessed to follow its last one (engine/sampling/speculative.py), verified by the
    # model in its next step; the scheduler may cut them, and they are dropped when it is preempted.
    draft_ids: list[int] = field(default_factory=list)
    # Overlapped steps (engine/worker/overlap.py): the last this many entries of `output_ids` are placeholders for tokens a
    # launched step computes; the engine writes them when it reads that step.
    num_pending: int = 0

    def __post_init__(self) -> None:
        if self.encoder_ids is not None and not self.num_states:
            self.num_states = len(self.encoder_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_input_tokens(self) -> int:
        """What the client's prompt came to: the encoder's input, or the decoder prompt."""
        return len(self.encoder_ids) if self.encoder_ids is not None else len(self.prompt_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (not those a launched step is still computing)."""
        return self.num_tokens - self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
