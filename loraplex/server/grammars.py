"""Grammars are compiled at the edge, before a request is queued: on worker threads (AsyncEngine), so
neither the event loop nor the engine thread waits on a compile, and a grammar that cannot be used is a
plain validation error (400 / 422) naming its field instead of a failed generation."""

from __future__ import annotations

import asyncio

from loraplex.engine.requests.request import RequestRefused
from loraplex.params import GrammarSpec
from loraplex.server.errors import BadRequest
from loraplex.server.state import ServerState


async def compile_grammars(state: ServerState, grammars: list[tuple[str, GrammarSpec] | None]) -> None:
    """Compile each (field, grammar) at once (None: nothing to compile); the first refusal, in the given order,
    is a BadRequest naming its field. The engine keeps what compiled, so queueing the request only copies it."""
    grammars = [g for g in grammars if g is not None]
    results = await asyncio.gather(*(state.engine.compile_grammar(spec) for _, spec in grammars), return_exceptions=True)
    for (field, _), result in zip(grammars, results):
        if isinstance(result, RequestRefused):
            raise BadRequest(f"{field}: {result}", field)
        if isinstance(result, BaseException):
            raise result
