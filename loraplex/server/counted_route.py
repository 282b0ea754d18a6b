"""Request bodies parsed off the event loop, and every list in them counted against its limit before validation.

FastAPI parses a JSON body and validates it on the event loop, and the validation of a list costs per element: one
request of a million chat messages held every other client (`/health` too) for seconds. `CountedRoute` (the route
class of the native and OpenAI routers) parses the body on a worker thread and counts the lists its route takes
(`COUNTED`: messages, their content parts, tools, stop sequences and token ids, logit biases, bad words,
allowed token ids, prompts) against their settings
(server/limits.py `check_count`); a list over its limit is refused (400 OpenAI / 422 native, naming the field and
the flag) before the validation sees it. A body that is not JSON is left to FastAPI, which answers as it always has.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request, Response
from fastapi.routing import APIRoute

from loraplex.server.limits import check_count
from loraplex.server.state import get_state

# A route's counted lists: (the field as clients name it, how many entries the raw body gives it, the setting).
Count = tuple[str, Callable[[dict], int], str]


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (list, dict)) else 0


def _messages(body: dict) -> list:
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def _content_parts(messages: list) -> int:
    return sum(_length(m.get("content")) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))


def _parameters(body: dict) -> dict:
    parameters = body.get("parameters")
    return parameters if isinstance(parameters, dict) else {}  # anything else: the validation's to refuse


def _native_messages(body: dict) -> list:
    """The chat messages a native request's `inputs` holds as JSON (with apply_chat_template), else none."""
    parameters, inputs = _parameters(body), body.get("inputs")
    if not (parameters.get("apply_chat_template") and isinstance(inputs, str)
            and inputs.lstrip().startswith("[")):
        return []
    try:
        messages = json.loads(inputs)
    except (ValueError, RecursionError):
        return []
    return messages if isinstance(messages, list) else []


def _stops(body: dict) -> int:
    stop = body.get("stop")
    return 1 if isinstance(stop, str) else _length(stop)


def _prompts(body: dict) -> int:
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


_SAMPLING: list[Count] = [
    ("stop", _stops, "max_stop_sequences"),
    ("stop_token_ids", lambda b: _length(b.get("stop_token_ids")), "max_stop_token_ids"),
    ("logit_bias", lambda b: _length(b.get("logit_bias")), "max_logit_bias"),
    ("bad_words", lambda b: _length(b.get("bad_words")), "max_bad_words"),
    ("allowed_token_ids", lambda b: _length(b.get("allowed_token_ids")), "max_allowed_token_ids"),
]
_NATIVE: list[Count] = [
    ("parameters.stop", lambda b: _length(_parameters(b).get("stop")), "max_stop_sequences"),
    ("inputs (chat messages)", lambda b: len(b.get("_messages", ())), "max_messages"),
    ("inputs (chat messages' content)", lambda b: _content_parts(b.get("_messages", [])), "max_content_parts"),
]
_CHAT: list[Count] = [
    ("messages", lambda b: len(_messages(b)), "max_messages"),
    ("messages[].content", lambda b: _content_parts(_messages(b)), "max_content_parts"),
    ("tools", lambda b: _length(b.get("tools")), "max_tools"),
]
COUNTED: dict[str, list[Count]] = {
    "/v1/chat/completions": [*_CHAT, *_SAMPLING],
    "/tokenize": _CHAT,  # vLLM's chat body: its lists bounded as the chat route bounds them
    "/v1/completions": [("prompt", _prompts, "max_concurrent_requests"), *_SAMPLING],
    "/generate": _NATIVE,
    "/generate_stream": _NATIVE,
    "/": _NATIVE,
}


def _parsed(raw: bytes, native: bool) -> Any:
    """The body parsed (on a worker thread); a native body's chat messages parsed from `inputs` beside it."""
    body = json.loads(raw)
    if native and isinstance(body, dict):
        return body, _native_messages(body)
    return body, None


class CountedRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handle = super().get_route_handler()
        counts = COUNTED.get(self.path)
        if counts is None or "POST" not in self.methods:
            return handle
        native = counts is _NATIVE

        async def counted(request: Request) -> Response:
            raw = await request.body()
            if raw:
                try:
                    body, messages = await asyncio.to_thread(_parsed, raw, native)
                except (ValueError, RecursionError):
                    return await handle(request)  # not JSON: FastAPI answers as always
                request._json = body  # what FastAPI's own parse would have given (starlette caches it there)
                if isinstance(body, dict):
                    state = get_state(request)
                    counted_body = {**body, "_messages": messages} if native else body
                    for param, count, setting in counts:
                        check_count(state, param, count(counted_body), setting)
            return await handle(request)

        return counted
