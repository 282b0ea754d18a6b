"""Work a request costs before it is admitted, bounded: a length check before tokenization, and the tokenizer,
chat templates and large serialisations on bounded pools of `--validation-workers` threads, never on the event
loop.

A prompt of more characters than `max_input_length` x the tokenizer's longest token cannot fit the model's input
(tokenizer.longest_token_chars says why), so it is refused before a tokenizer is asked to build a million-token
list of it; the small slack covers normalizers that compose characters (NFC: "e" + U+0301 -> "é").

Two pools, so that a flood of one kind of work cannot starve the other (issue 58): the generation routes' prompts
(tokenization, chat templates, images) on one, the token routes' work (`/tokenize`, `/detokenize`: their answers
are O(input)) on the other, each of `--validation-workers` threads. A route picks the token routes' pool for the
rest of its request with `with validation.token_routes():` (a context variable: what it awaits, such as
server/images.py `encode_prompt`, runs there too). Each pool holds at most its workers + its queue bound
(GENERATION_QUEUE, TOKEN_ROUTE_QUEUE) jobs; one more is refused at once with admission.Overloaded (429 +
`Retry-After`, as a full server answers) instead of waiting behind a queue that only grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

from loraplex.server.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Overloaded

T = TypeVar("T")

NORMALIZER_SLACK = 2  # characters a normalizer may fold into one
# Jobs a pool lets wait for a worker, beyond those its workers run; one more is answered 429 + Retry-After.
# Generation's: twice --max-concurrent-requests' default (128), so that admission (server/admission.py), not this,
# is what refuses a busy server's requests. The token routes': a few requests per worker, each at most
# --max-input-length tokens (a few hundred ms of work), so none waits long.
GENERATION_QUEUE = 256
TOKEN_ROUTE_QUEUE = 16
_JOB_TIME_WEIGHT = 0.2  # of the newest job in a pool's moving average of job seconds (its Retry-After estimate)


class InputTooLong(ValueError):
    """A prompt refused by its length in characters or tokens (422 native, 400 OpenAI, as a BadRequest); `param`
    names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class BoundedPool:
    """A thread pool that holds at most `workers + queue` jobs (waiting or running); one more raises Overloaded at
    once, with a Retry-After of the time its workers need for the jobs held (a moving average of job seconds)."""

    def __init__(self, name: str, workers: int, queue: int) -> None:
        self.name = name
        self.workers = max(1, workers)
        self.queue = queue
        self.executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=f"loraplex-{name}")
        self._lock = threading.Lock()  # `held` drops on a worker thread (the job's done callback)
        self.held = 0
        self.job_seconds = 0.0

    async def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self.held >= self.workers + self.queue:
                raise Overloaded(
                    f"model is overloaded: {self.held} jobs are waiting for or running on the {self.name} workers "
                    f"(at most {self.workers} workers + {self.queue} queued)", self.retry_after())
            self.held += 1
        try:
            future = self.executor.submit(self._timed, fn)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)  # also when cancelled before it ran (its client went away)
        return await asyncio.wrap_future(future)

    def _timed(self, fn: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            spent = time.perf_counter() - started
            with self._lock:
                self.job_seconds += _JOB_TIME_WEIGHT * (spent - self.job_seconds)

    def _release(self, _future) -> None:
        with self._lock:
            self.held -= 1

    def retry_after(self) -> int:
        """Whole seconds for the workers to finish the jobs held, at the recent seconds per job (1 to 60)."""
        seconds = math.ceil(self.held * self.job_seconds / self.workers)
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, seconds))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


_TOKEN_ROUTES: contextvars.ContextVar[bool] = contextvars.ContextVar("loraplex_token_routes", default=False)


class Validation:
    """The server's validation workers (generation's and the token routes' pools) and its bounds on prompts."""

    def __init__(self, workers: int, max_input_length: int, longest_token_chars: int) -> None:
        self.pool = BoundedPool("validation", workers, GENERATION_QUEUE)
        self.token_pool = BoundedPool("token-routes", workers, TOKEN_ROUTE_QUEUE)
        self.max_chars = max_input_length * longest_token_chars * NORMALIZER_SLACK
        self.max_input_length = max_input_length

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on a validation worker (the token routes' within `token_routes()`, else
        generation's); the event loop goes on meanwhile. Overloaded when that pool is full."""
        pool = self.token_pool if _TOKEN_ROUTES.get() else self.pool
        return await pool.run(functools.partial(fn, *args, **kwargs))

    @contextlib.contextmanager
    def token_routes(self) -> Iterator[None]:
        """Within it, `run` uses the token routes' pool (for the task that entered it: one request)."""
        token = _TOKEN_ROUTES.set(True)
        try:
            yield
        finally:
            _TOKEN_ROUTES.reset(token)

    def check_length(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit the model's input, before it is tokenized."""
        if len(text) > self.max_chars:
            raise InputTooLong(
                f"{param} has {len(text)} characters, more than {self.max_input_length} tokens (max input length) "
                f"can hold with this tokenizer (at most {self.max_chars} characters)", param)

    def check_tokens(self, count: int, param: str, limit: int | None = None, name: str = "max input length") -> None:
        """Refuse `count` tokens past `limit` (default --max-input-length), before any work per token."""
        limit = self.max_input_length if limit is None else limit
        if count > limit:
            raise InputTooLong(f"{param} has {count} tokens, more than {limit} ({name})", param)

    def close(self) -> None:
        self.pool.close()
        self.token_pool.close()
