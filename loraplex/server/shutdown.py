"""Graceful shutdown with a deadline: on SIGTERM (or SIGINT) the server stops accepting connections and lets the
requests in flight finish for `--shutdown-timeout-s`; then every one still running ends, a stream with an error
event ("server shutting down", in its API's shape) and a request not yet answered with a 503
(server/disconnects.py), and the process exits 0. Orchestrators send SIGKILL some time after SIGTERM (Kubernetes:
30 s): a deadline under theirs lets every client hear why its stream ended."""

from __future__ import annotations

import asyncio
import signal
import weakref

import uvicorn

# uvicorn's own bound on waiting for connections to close, past ours: a last resort, should one not close.
BACKSTOP_S = 5.0


class ShutdownSignal:
    """Set once at the deadline; awaited by every request. One asyncio.Event per event loop that waits (an Event
    is bound to the first loop it waits on; tests run the app under several)."""

    def __init__(self) -> None:
        self._events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.is_set = False

    async def wait(self) -> None:
        event = self._events.setdefault(asyncio.get_running_loop(), asyncio.Event())
        if not self.is_set:
            await event.wait()

    def set(self) -> None:
        """From the loop's own thread."""
        self.is_set = True
        for event in self._events.values():
            event.set()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutting_down: ShutdownSignal, deadline_s: float) -> None:
        config.timeout_graceful_shutdown = deadline_s + BACKSTOP_S
        super().__init__(config)
        self.shutting_down, self.deadline_s = shutting_down, deadline_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in getattr(self, "_captured_signals", ()):
            # uvicorn re-raises a captured signal once it has shut down, so the process dies of it (status
            # -15); a drain that ended as planned exits 0 instead, as orchestrators expect of SIGTERM.
            self._captured_signals.remove(sig)
        if first and self._loop is not None:  # a second signal forces the exit (uvicorn's), ours changes nothing
            self._loop.call_soon_threadsafe(self._loop.call_later, self.deadline_s, self.shutting_down.set)
