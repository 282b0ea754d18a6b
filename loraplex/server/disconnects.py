"""Requests whose client goes away stop at once, streamed or not.

Starlette notices a disconnect only while it streams a response; a plain (JSON) response would run its
generation to the end for nobody, holding its concurrency slot, its KV blocks and its adapter's pin. This ASGI
middleware reads the request body first (and hands it to the app unchanged), then watches the connection: when
the client disconnects before the response is complete, the app's task is cancelled. Cancelling closes the
engine streams the route is iterating, which aborts their requests (AsyncEngine.generate) and releases the slot
(ServerState.generate). With a deadline (`--request-timeout-s`) a request that overruns it is cancelled the same
way and answered 504 if its response has not started.
"""

from __future__ import annotations

import asyncio
import contextlib

from loraplex.server import request_log
from loraplex.server.errors import native_error, openai_error

CLIENT_CLOSED = 499  # the status the request's log line gets (nginx's convention)


class CancelOnDisconnect:
    def __init__(self, app, timeout_s: float | None = None) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body: list[dict] = []
        while True:  # the whole body first: afterwards the only message left is the disconnect
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.append(message)
            if not message.get("more_body", False):
                break
        gone = asyncio.Event()
        started = False

        async def replay() -> dict:
            if body:
                return body.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send_and_note(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        app = asyncio.create_task(self.app(scope, replay, send_and_note))
        watcher = asyncio.create_task(watch())
        try:
            done, _ = await asyncio.wait({app, watcher}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if app in done:
                return app.result()
            app.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await app
            record = request_log.current()
            if watcher in done:  # the client left
                if record is not None:
                    record.status = CLIENT_CLOSED
            elif not started:  # the deadline passed first
                message = f"the request took longer than {self.timeout_s:g} s (--request-timeout-s)"
                timeout = (openai_error(504, message, "timeout_error", code="timeout") if scope["path"].startswith("/v1/")
                           else native_error(504, message, "timeout"))
                await timeout(scope, replay, send)
        finally:
            watcher.cancel()
            if not app.done():
                app.cancel()
