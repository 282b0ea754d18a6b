"""What every route shares: the engine, the edge limits, metrics, and one way to run a request.

`ServerState.generate` is the single path from a route to the engine: it enforces the concurrency
limit (429), counts metrics, and turns engine failures into `GenerationFailed`. Routes only translate
protocol <-> `SamplingParams` / `RequestOutput`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine, RequestOutput
from loraplex.params import SamplingParams, TokenInfo
from loraplex.server.metrics import Metrics


@dataclass
class Finished:
    """A request run to its end: the final output and every generated token."""

    final: RequestOutput
    tokens: list[TokenInfo]

    @property
    def logprob_sum(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


class Overloaded(Exception):
    """More requests in flight than --max-concurrent-requests."""


class GenerationFailed(RuntimeError):
    """The engine failed while running the request (not the caller's fault)."""


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    metrics: Metrics
    in_flight: int = 0
    started_at: float = field(default_factory=time.time)

    @property
    def core(self) -> Engine:
        return self.engine.engine

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_id(self) -> str:
        return self.core.model_id

    def admit(self) -> None:
        """Reserve a slot for one request, or raise Overloaded at once."""
        if self.in_flight >= self.config.max_concurrent_requests:
            raise Overloaded(
                f"model is overloaded: {self.in_flight} requests in flight "
                f"(max concurrent requests {self.config.max_concurrent_requests})"
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs.

        Before the first output it raises Overloaded (too many in flight) or RequestRefused (the engine
        cannot take it); later, GenerationFailed when the engine fails mid-way. Closing the iterator
        aborts the request and frees its slot.
        """
        self.admit()
        request_id = uuid.uuid4().hex
        self.metrics.on_request(len(prompt_ids))
        stream = self.engine.generate(prompt_ids, params, request_id)
        try:
            async for out in stream:
                if out.finished:
                    self.metrics.on_success(out)
                yield out
        except RuntimeError as exc:  # counted here: mid-stream failures never reach an error handler
            self.metrics.on_failure("generation")
            raise GenerationFailed(str(exc)) from exc
        finally:
            await stream.aclose()
            self.release()


async def run_to_end(state: ServerState, prompt_ids: list[int], params: SamplingParams) -> Finished:
    tokens: list[TokenInfo] = []
    final = None
    async for final in state.generate(prompt_ids, params):
        if final.token is not None:
            tokens.append(final.token)
    assert final is not None and final.finished
    return Finished(final, tokens)


def get_state(request: Request) -> ServerState:
    return request.app.state.loraplex
