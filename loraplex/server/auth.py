"""`--api-key`: every route but the health routes answers only requests bearing one of the server's keys
(`Authorization: Bearer KEY`, as OpenAI clients send their api_key). `/health` and `/ping` (SageMaker's), GET or
HEAD, stay open for load balancers' and orchestrators' probes, and so does every OPTIONS request: a browser's CORS
preflight never carries credentials (with `--cors-allow-origin` the CORS layer, outside this one, answers it and
puts its headers on a 401 too). Keys are compared in constant time; a refusal says nothing about which keys exist.
The key is checked on the headers alone, outside the layer that reads bodies (server/disconnects.py): a request
without one is answered 401 before a byte of its body is read (the server discards whatever of it still comes).
"""

from __future__ import annotations

import hmac
from typing import Sequence

from loraplex.server.errors import error_for_path

OPEN_PATHS = ("/health", "/ping")


class ApiKeys:
    def __init__(self, app, keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS"
                or self._allowed(scope)):
            return await self.app(scope, receive, send)
        message = "a valid API key is required: send it as 'Authorization: Bearer KEY'"
        response = error_for_path(scope["path"], 401, message, "unauthorized", "authentication_error",
                                  code="invalid_api_key")
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _allowed(self, scope) -> bool:
        given = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # Every key is compared (no early exit): the time taken does not tell which one was close.
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0
