"""Drives the synchronous Engine from one background thread and streams outputs to asyncio callers.

The engine is only ever touched by its thread. Callers talk to it through a queue of typed commands
(AddRequest / AbortRequest); outputs come back through each request's asyncio.Queue via call_soon_threadsafe.
The thread blocks on a condition when there is no work, so an idle server burns no CPU.

The server reads only this facade: `model` (a frozen description of the served model), `stats()`, `alive`, and
the calls below; never the `Engine` behind it.

If the thread itself dies (an error outside a step's own handling), every waiting caller is failed at once
and later calls fail before they queue: nothing hangs on a queue nobody will fill, and `alive` says so (the
server's /health answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from loraplex.engine.engine import Engine
from loraplex.engine.requests.output import RequestOutput
from loraplex.engine.requests.request import RequestRefused
from loraplex.engine.served_model import ServedModel
from loraplex.engine.stats import EngineStats
from loraplex.lora.adapter import LoraAdapter
from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.params import GrammarSpec, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (the arguments of `Engine.add_request`)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: LoraAdapter | None
    images: ImageInputs | None


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (its caller left, or asked)."""

    request_id: str


@dataclass(frozen=True)
class RetireAdapter:
    """No new request will name this adapter (its name was unloaded or replaced): free its slot once unused."""

    key: str


@dataclass(frozen=True)
class HoldAdapter:
    """This adapter keeps its device slot once it has one (a pinned run-time load)."""

    key: str


Command = AddRequest | AbortRequest | RetireAdapter | HoldAdapter


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine  # touched by the engine thread only (and by tests)
        self.model: ServedModel = engine.describe()
        self._commands: deque[Command] = deque()
        self._wake = threading.Condition()
        self._subscribers: dict[str, _Subscriber] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.died: BaseException | None = None  # why the engine thread stopped, if it did
        self.last_step_at: float | None = None  # time.monotonic() when a step last completed (None after a failure)
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) ---------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        adapter: LoraAdapter | None = None, images: ImageInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per generated token; the last has finished=True.

        Raises RequestRefused (before any output) when the engine cannot take the request. Leaving
        the iteration early (client gone) aborts the request; its KV blocks are freed next step.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        if not self.alive:
            raise RuntimeError(f"the engine stopped: {self.died!r}")
        subscriber = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        self._subscribers[request_id] = subscriber
        self._send(AddRequest(request_id, prompt_ids, params, adapter, images))
        finished = False
        try:
            while True:
                item = await subscriber.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._subscribers.pop(request_id, None)
            if not finished:
                self._send(AbortRequest(request_id))

    def prepare_grammars(self) -> threading.Thread:
        """Ready the grammar engine for structured output on a thread of its own, now (engine/requests/inputs.py
        `GrammarCache.prepare`): the first structured-output request then finds it ready."""
        def prepare() -> None:
            try:
                self.engine.inputs.grammars.prepare()
            except Exception as exc:  # noqa: BLE001  (a tokenizer the grammar engine cannot read: its first use says so)
                log.info("structured output not readied at start: %r", exc)

        thread = threading.Thread(target=prepare, name="loraplex-grammars", daemon=True)
        thread.start()
        return thread

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile a request's grammar on a worker thread, before the request is queued, so that the engine
        thread never waits on a compile. Raises RequestRefused when the grammar is unusable or not compiled
        within the limit (Python cannot stop the compile: it finishes in its thread, bounded by llguidance's
        own limits, and the engine remembers the grammar as refused)."""
        limit = self.engine.config.grammar_compile_timeout_s
        try:
            await asyncio.wait_for(asyncio.to_thread(self.engine.compile_grammar, spec), limit)
        except TimeoutError:
            raise RequestRefused(
                f"grammar refused: {spec.kind} did not compile within {limit:g} s (grammar compile timeout)"
            ) from None

    def stats(self) -> EngineStats:
        """The engine's queues, caches and counters now (a snapshot built on the asking thread)."""
        return self.engine.stats()

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs (False once it died, or after shutdown)."""
        return self.died is None and self._thread.is_alive()

    def stepped_within(self, seconds: float) -> bool:
        """Whether the thread is alive and completed a step in the last `seconds` (the model works right now)."""
        return self.alive and self.last_step_at is not None and time.monotonic() - self.last_step_at <= seconds

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def hold_adapter(self, key: str) -> None:
        """The adapter of store key `key` keeps its device slot once it has one, until it is retired."""
        self._send(HoldAdapter(key))

    def retire_adapter(self, key: str) -> None:
        """The adapter of store key `key` serves no new request: its device slot is freed once its requests end."""
        self._send(RetireAdapter(key))

    def shutdown(self) -> None:
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=10)

    def _send(self, command: Command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 — whatever it was, no caller may wait for it forever
            self.died = error
            log.critical("the engine thread stopped", exc_info=error)
            for request_id in list(self._subscribers):
                self._deliver(request_id, RuntimeError(f"generation failed: the engine stopped ({error!r})"))

    def _loop(self) -> None:
        while not self._stopped:
            with self._wake:
                while not self._stopped and not self._commands and not self.engine.has_unfinished:
                    self._wake.wait()
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                self._apply(command)
            if self.engine.has_unfinished:
                self._step()

    def _apply(self, command: Command) -> None:
        match command:
            case AddRequest():
                try:
                    self.engine.add_request(command.prompt_ids, command.params, command.request_id, command.adapter,
                                            command.images)
                except Exception as error:  # refused: only this caller hears of it
                    self._deliver(command.request_id, error)
            case AbortRequest():
                self.engine.abort_request(command.request_id)
            case RetireAdapter():
                self.engine.retire_adapter(command.key)
            case HoldAdapter():
                self.engine.hold_adapter(command.key)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # a failed forward fails the running requests, not the server
            log.exception("engine step failed")
            self.last_step_at = None  # the next health check runs a probe rather than trust earlier steps
            for request in list(self.engine.scheduler.running):
                self.engine.abort_request(request.request_id)
                self._deliver(request.request_id, RuntimeError(f"generation failed: {error}"))
            return
        self.last_step_at = time.monotonic()
        for output in outputs:
            failed = output.error is not None  # this request alone failed; the others go on
            self._deliver(output.request_id, RuntimeError(f"generation failed: {output.error}") if failed else output)

    def _deliver(self, request_id: str, item: object) -> None:
        subscriber = self._subscribers.get(request_id)
        if subscriber is None:  # caller gone: make sure the engine forgets it too
            self.engine.abort_request(request_id)
            return
        subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, item)
