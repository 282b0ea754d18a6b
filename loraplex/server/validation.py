"""Work a request costs before it is admitted, bounded: a length check before tokenization, and the tokenizer,
chat templates and large serialisations on a pool of `--validation-workers` threads, never on the event loop.

A prompt of more characters than `max_input_length` x the tokenizer's longest token cannot fit the model's input
(tokenizer.longest_token_chars says why), so it is refused before a tokenizer is asked to build a million-token
list of it; the small slack covers normalizers that compose characters (NFC: "e" + U+0301 -> "é").
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class InputTooLong(ValueError):
    """A prompt refused by its length in characters (422 native, 400 OpenAI, as a BadRequest); `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
NORMALIZER_SLACK = 2  # characters a normalizer may fold into one


class Validation:
    """The server's validation workers and its character bound on prompts."""

    def __init__(self, workers: int, max_input_length: int, longest_token_chars: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="loraplex-validation")
        self.max_chars = max_input_length * longest_token_chars * NORMALIZER_SLACK
        self.max_input_length = max_input_length

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on a validation worker; the event loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def check_length(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit the model's input, before it is tokenized."""
        if len(text) > self.max_chars:
            raise InputTooLong(
                f"{param} has {len(text)} characters, more than {self.max_input_length} tokens (max input length) "
                f"can hold with this tokenizer (at most {self.max_chars} characters)", param)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
