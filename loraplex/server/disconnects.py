"""Requests whose client goes away stop at once, streamed or not.

Starlette notices a disconnect only while it streams a response; a plain (JSON) response would run its
generation to the end for nobody, holding its concurrency slot, its KV blocks and its adapter's pin. This ASGI
middleware reads the request body first (and hands it to the app unchanged), then watches the connection: when
the client disconnects before the response is complete, the app's task is cancelled. Cancelling closes the
engine streams the route is iterating, which aborts their requests (AsyncEngine.generate) and releases the slot
(ServerState.generate). With a deadline (`--request-timeout-s`) a request that overruns it is cancelled the same
way: answered 504 if its response has not started, and a stream that started ends with an error event in its
API's shape (then OpenAI's `[DONE]`). At a shutdown's deadline (`ServerState.shutting_down`, set by the server
`--shutdown-timeout-s` after SIGTERM) every request still running ends the same way, 503 or "server shutting
down". Each is logged with its outcome (client_gone, timed_out, shutdown) and counted as a failure of that kind.

Since it reads every body, it also caps their size (`--max-request-bytes`): a larger body is answered 413 before
the app sees a byte of it (by its Content-Length at once, or as soon as the bytes read pass the cap). And it cuts
slow senders: a body whose next part does not arrive within BODY_READ_TIMEOUT_S (a client that declares 1,000
bytes and sends 10) is answered 408, and its connection closed. With `--api-key` this layer sits inside ApiKeys
(server/app.py): a request without a valid key is answered 401 before a byte of its body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from loraplex.server import request_log
from loraplex.server.errors import error_for_path

CLIENT_CLOSED = 499  # the log line's status when the client left before any response (nginx's convention)
# The longest wait for the next part of a request's body (its first part included), as nginx's client_body_timeout:
# a client that stops sending is answered 408 and its connection closed; one that keeps sending, however slowly
# its whole body arrives, is never cut by it (the body is still capped by --max-request-bytes).
BODY_READ_TIMEOUT_S = 10.0


class CancelOnDisconnect:
    def __init__(self, app, timeout_s: float | None = None, max_body_bytes: int | None = None) -> None:
        self.app, self.timeout_s, self.max_body_bytes = app, timeout_s, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = error_for_path(scope["path"], 413, f"the request body is larger than {self.max_body_bytes} bytes "
                                       "(--max-request-bytes)", "payload_too_large")
        if self.max_body_bytes is not None and _content_length(scope) > self.max_body_bytes:
            return await too_large(scope, receive, send)
        body: list[dict] = []
        size = 0
        while True:  # the whole body first: afterwards the only message left is the disconnect
            try:
                async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                    message = await receive()
            except TimeoutError:
                return await _too_slow(scope, receive, send)
            if message["type"] == "http.disconnect":  # gone before its body was whole: nothing ran
                if (record := request_log.current()) is not None:
                    record.outcome, record.status = "client_gone", CLIENT_CLOSED
                return
            body.append(message)
            size += len(message.get("body", b""))
            if self.max_body_bytes is not None and size > self.max_body_bytes:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        gone = asyncio.Event()
        started = streaming = False

        async def replay() -> dict:
            if body:
                return body.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send_and_note(message) -> None:
            nonlocal started, streaming
            if message["type"] == "http.response.start":
                started = True
                streaming = any(name == b"content-type" and value.startswith(b"text/event-stream")
                                for name, value in message.get("headers", ()))
            await send(message)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        state = getattr(getattr(scope.get("app"), "state", None), "loraplex", None)
        app = asyncio.create_task(self.app(scope, replay, send_and_note))
        watcher = asyncio.create_task(watch())
        shutdown = asyncio.create_task(state.shutting_down.wait()) if state is not None else None
        try:
            waiting = {app, watcher} | ({shutdown} if shutdown else set())
            done, _ = await asyncio.wait(waiting, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if app in done:
                return app.result()
            app.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await app
            record = request_log.current()
            if watcher in done:  # the client left (a response already started keeps its status; complete=false)
                if record is not None:
                    record.outcome = "client_gone"
                    if not started:
                        record.status = CLIENT_CLOSED
                if state is not None:
                    state.metrics.on_failure("client_gone")
                return
            if shutdown is not None and shutdown in done:
                outcome, status, kind, message = "shutdown", 503, "unavailable", "server shutting down"
            else:
                outcome, status, kind = "timed_out", 504, "timeout"
                message = f"the request took longer than {self.timeout_s:g} s (--request-timeout-s)"
            if record is not None:
                record.outcome, record.error = outcome, message
            if state is not None:
                state.metrics.on_failure(outcome)
            if not started:
                await error_for_path(scope["path"], status, message, kind)(scope, replay, send)
            elif streaming:  # the client hears why its stream ends, in its API's shape
                await send({"type": "http.response.body", "body": error_event(scope["path"], message, kind),
                            "more_body": False})
        finally:
            watcher.cancel()
            if shutdown is not None:
                shutdown.cancel()
            if not app.done():
                app.cancel()


async def _too_slow(scope, receive, send) -> None:
    """408 for a body that stopped arriving, in the route's API shape; the connection is closed after it (the rest
    of the body, should it come, is not waited for)."""
    message = f"the request body stopped arriving: nothing came for {BODY_READ_TIMEOUT_S:g} s"
    response = error_for_path(scope["path"], 408, message, "body_timeout")
    response.headers["connection"] = "close"
    await response(scope, receive, send)


def error_event(path: str, message: str, kind: str) -> bytes:
    """The last event of a stream cut by the server, as the route's API writes errors (OpenAI's then [DONE])."""
    if path.startswith("/v1/"):
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": kind}}
        return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    return f"data: {json.dumps({'error': message, 'error_type': kind})}\n\n".encode()


def _content_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
