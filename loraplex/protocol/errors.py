"""The one error the protocol layer raises: a field value the server refuses, named."""

from __future__ import annotations


class Unsupported(ValueError):
    """A field value this server refuses; `param` names the field (OpenAI routes answer 400, native ones 422)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
