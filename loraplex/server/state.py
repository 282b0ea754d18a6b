"""What every route shares: the engine, the edge limits, metrics, and one way to run a request.

`ServerState.generate` is the single path from a route to the engine: it enforces the admission limits
(429 + Retry-After, server/admission.py), counts metrics, and turns engine failures into `GenerationFailed`.
Routes only translate protocol <-> `SamplingParams` / `RequestOutput`.
"""

from __future__ import annotations

import string
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import quote
from typing import AsyncIterator

from fastapi import Request

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.requests.output import RequestOutput
from loraplex.engine.served_model import ServedModel
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.sources.store import AdapterStore, MergeSpec
from loraplex.params import SamplingParams, TokenInfo
from loraplex.server.admission import Admission, Seat
from loraplex.server.metrics import BASE_ADAPTER, Metrics
from loraplex.server.shutdown import ShutdownSignal
from loraplex.server.validation import Validation
from loraplex.server.request_log import note_adapter, note_failure, note_token, note_unfinished_run


@dataclass
class Finished:
    """A request run to its end: the final output and every generated token."""

    final: RequestOutput
    tokens: list[TokenInfo]

    @property
    def logprob_sum(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


class GenerationFailed(RuntimeError):
    """The engine failed while running the request (not the caller's fault)."""


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    metrics: Metrics
    adapters: AdapterStore
    admission: Admission = field(default_factory=Admission)
    started_at: float = field(default_factory=time.time)
    validation: Validation | None = None  # create_app's: the validation workers and the prompt length bound
    # The OpenAI routes' sampling defaults from the model's generation config (ServerConfig.generation_config).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # Set at a shutdown's deadline: every request still running ends (server/disconnects.py).
    shutting_down: ShutdownSignal = field(default_factory=ShutdownSignal)

    @property
    def model(self) -> ServedModel:
        """The served model's description: what the server knows of the engine besides its stats."""
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.model.tokenizer

    @property
    def model_id(self) -> str:
        """The base model's name as clients see it (--served-model-name's first, else the model id)."""
        return self.config.served_model_name[0] if self.config.served_model_name else self.engine.model.model_id

    @property
    def base_names(self) -> tuple[str, ...]:
        """Every name a request may give the base model: the served names, and the model id."""
        return tuple(dict.fromkeys([*self.config.served_model_name, self.engine.model.model_id]))

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def admit(self, prompt_tokens: int, max_new_tokens: int) -> Seat:
        """Reserve a seat for one sequence, or raise Overloaded (with its Retry-After) at once."""
        return self.admission.admit(prompt_tokens, max_new_tokens, self.config.max_concurrent_requests,
                                    self.config.max_queued_tokens)

    def admit_all(self, sequences: list[tuple[int, int]]) -> list[Seat]:
        """Seats for all of one request's sequences ((prompt tokens, max_new_tokens) each) at once, or Overloaded.
        Each goes to `generate(seat=...)`, which gives it back when its stream ends; a caller whose streams may
        not all start gives every seat back itself (`release_all`: a seat is given back once)."""
        return self.admission.admit_all(sequences, self.config.max_concurrent_requests, self.config.max_queued_tokens)

    def release_all(self, seats: list[Seat]) -> None:
        for seat in seats:
            self.admission.release(seat)

    async def adapter(
        self, adapter_id: str | None, source: str | None = None, merged: MergeSpec | None = None,
        api_token: str | None = None,
    ) -> LoraAdapter | None:
        """The adapter a request names (None: the base model), loaded off the engine loop. `api_token`: the
        request's Hugging Face token, checked for hub adapters on every request (never logged).

        Raises AdapterNotFound or AdapterInvalid; only this request waits for the load.
        """
        # Loaded, its log and metric label becomes its canonical id (one per adapter, not one per alias).
        canonical = self.adapters.canonical_id
        if merged is not None:
            adapter = await self.adapters.get_merged(merged, source, api_token)
            note_adapter(None, [canonical(i, self.adapters.source_of(source)) for i in merged.ids])
            return adapter
        if not adapter_id:
            return None
        adapter = await self.adapters.get(adapter_id, source, api_token)
        note_adapter(canonical(adapter_id, self.adapters.source_of(source)))
        return adapter

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: LoraAdapter | None = None,
        images: ImageInputs | None = None, seat: Seat | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one sequence's outputs (with `adapter`, or the base model), in `seat` (`admit_all`'s) or in a
        seat of its own.

        Before the first output it raises Overloaded (over an admission limit) or RequestRefused (the engine
        cannot take it); later, GenerationFailed when the engine fails mid-way. Closing the iterator
        aborts the request and frees its slot.
        """
        if seat is None:
            seat = self.admit(len(prompt_ids), params.max_new_tokens)
        request_id = uuid.uuid4().hex
        label = adapter.adapter_id if adapter is not None else BASE_ADAPTER
        self.metrics.on_request(len(prompt_ids), label, params.max_new_tokens)
        stream = self.engine.generate(prompt_ids, params, request_id, adapter, images)
        started, finished = time.perf_counter(), False
        try:
            async for out in stream:
                if out.token is not None:
                    self.admission.generated(seat)
                    note_token()
                if out.finished:
                    finished = True
                    self.metrics.on_success(out, label)
                yield out
        except RuntimeError as exc:  # counted here: mid-stream failures never reach an error handler
            self.metrics.on_failure("generation")
            note_failure(str(exc))
            raise GenerationFailed(str(exc)) from exc
        finally:
            if not finished:
                note_unfinished_run(time.perf_counter() - started)
            await stream.aclose()
            self.admission.release(seat)


async def run_to_end(
    state: ServerState, prompt_ids: list[int], params: SamplingParams, adapter: LoraAdapter | None = None,
    images: ImageInputs | None = None, seat: Seat | None = None,
) -> Finished:
    tokens: list[TokenInfo] = []
    final = None
    async for final in state.generate(prompt_ids, params, adapter, images, seat):
        if final.token is not None:
            tokens.append(final.token)
    assert final is not None and final.finished
    return Finished(final, tokens)


# Printable ASCII but "%" stays as it is in the header; the rest (spaces, controls, non-ASCII) is percent-encoded.
_HEADER_SAFE = string.punctuation.replace("%", "")


def adapter_header(adapter: LoraAdapter | None) -> dict[str, str]:
    """`x-adapter-id`: the adapter that served the request (absent for the base model), by its canonical id,
    percent-encoded where a header could not carry it (latin-1 only, no controls)."""
    return {} if adapter is None else {"x-adapter-id": quote(adapter.adapter_id, safe=_HEADER_SAFE)}


def get_state(request: Request) -> ServerState:
    return request.app.state.loraplex
