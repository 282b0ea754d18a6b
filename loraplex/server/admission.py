"""Admission control: how much work the server takes on, and when a refused client should come back.

Two limits, both checked when a request arrives and both answered at once with 429 + `Retry-After`:
`--max-concurrent-requests` (sequences in flight) and `--max-queued-tokens` (prompt tokens + max_new_tokens of
the sequences in flight: admitted and not yet finished, whether waiting in the engine's queue, preempted or
running). Refusing at the door instead of queueing without bound keeps the admitted requests' latency bounded
and the server responsive at any load. Everything here runs on the event loop: no locks.

A request is counted as the sequences it makes: OpenAI's `n` (or `best_of`) times its prompts, the native
`best_of`; each takes one seat of --max-concurrent-requests, all admitted at once or none (`Admission.admit_all`).
So that one request cannot take every seat (issue 58: `n=128` held all 128 for 84 s while every other client got
429), a request may make at most `sequences_per_request(--max-concurrent-requests)` sequences: a quarter of the
limit, at least 1. More is the client's error, refused at once with 400 (422 native) naming `n` / `best_of`,
never a 429 that no retry could cure.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
RATE_WINDOW_S = 10
# One request's share of --max-concurrent-requests: at most 1/SEQUENCE_SHARE_DIVISOR of the seats (at least 1).
SEQUENCE_SHARE_DIVISOR = 4


def sequences_per_request(max_concurrent_requests: int, asked: int | None = None) -> int:
    """The most sequences (n x prompts, best_of) one request may make: `asked` (--max-sequences-per-request), else a
    quarter of --max-concurrent-requests, at least 1, so that three quarters of the seats stay for the other clients
    whatever one request asks."""
    if asked is not None:
        return min(asked, max_concurrent_requests)
    return max(1, max_concurrent_requests // SEQUENCE_SHARE_DIVISOR)


class Overloaded(Exception):
    """Over --max-concurrent-requests or --max-queued-tokens; `retry_after` is the seconds to wait (>= 1)."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_MIN_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_seconds(pending_output_tokens: int, tokens_per_second: float | None) -> int:
    """The `Retry-After` of a 429, in whole seconds.

    The time the server needs to generate the output tokens it has already promised (the max_new_tokens its
    requests in flight have left), at the rate it generated tokens recently: when the admitted work will have
    drained. That overestimates (requests often stop early, and one freed slot would do), which is the safe
    side under overload: a client that comes back too early only adds load. Clamped to 1..60 s so that a
    stale or tiny rate never sends clients away for long; 1 s when nothing is known (no recent tokens).
    """
    if not tokens_per_second or tokens_per_second <= 0:
        return RETRY_AFTER_MIN_S
    seconds = math.ceil(pending_output_tokens / tokens_per_second)
    return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, seconds))


class TokenRate:
    """Generated tokens per second over the last RATE_WINDOW_S seconds (counts kept per whole second)."""

    def __init__(self, window_s: int = RATE_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._seconds: deque[list[int]] = deque()  # [second, tokens], oldest first

    def add(self, tokens: int = 1) -> None:
        now = int(self.clock())
        if self._seconds and self._seconds[-1][0] == now:
            self._seconds[-1][1] += tokens
        else:
            self._seconds.append([now, tokens])
        self._forget_before(now)

    def per_second(self) -> float | None:
        """None when no token was made within the window."""
        now = self.clock()
        self._forget_before(int(now))
        if not self._seconds:
            return None
        # Over the time since the oldest counted second (at least 1 s): a burst just begun is not a rate of zero.
        span = max(1.0, now - self._seconds[0][0])
        return sum(tokens for _, tokens in self._seconds) / span

    def _forget_before(self, now: int) -> None:
        while self._seconds and self._seconds[0][0] <= now - self.window_s:
            self._seconds.popleft()


@dataclass
class Seat:
    """One admitted sequence's share of the load, given back (once) by `Admission.release`."""

    tokens: int  # prompt + max_new_tokens
    unspent: int  # max_new_tokens not generated yet
    released: bool = False


@dataclass
class Admission:
    """The load admitted and not yet finished (counted in sequences), and the recent output-token rate."""

    in_flight: int = 0  # sequences admitted and not finished: seats taken of --max-concurrent-requests
    queued_tokens: int = 0  # prompt + max_new_tokens of the sequences in flight
    pending_output_tokens: int = 0  # max_new_tokens the sequences in flight have not generated yet
    rate: TokenRate = field(default_factory=TokenRate)

    def admit(self, prompt_tokens: int, max_new_tokens: int, max_requests: int, max_tokens: int | None) -> Seat:
        """A seat for one sequence, or Overloaded at once."""
        return self.admit_all([(prompt_tokens, max_new_tokens)], max_requests, max_tokens)[0]

    def admit_all(
        self, sequences: list[tuple[int, int]], max_requests: int, max_tokens: int | None
    ) -> list[Seat]:
        """A seat for each of one request's sequences ((prompt tokens, max_new_tokens) each), all or none, or
        Overloaded at once. A request is always admitted when nothing is in flight, so that --max-queued-tokens
        below one request's size cannot keep it out forever (its sequences are at most a share of max_requests:
        the routes refuse more, `sequences_per_request`)."""
        count = len(sequences)
        tokens = sum(p + m for p, m in sequences)
        if self.in_flight + count > max_requests:
            if count == 1:
                reason = f"{self.in_flight} requests in flight (max concurrent requests {max_requests})"
            else:
                reason = (f"{self.in_flight} sequences in flight + {count} of this request > {max_requests} "
                          "(max concurrent requests)")
        elif max_tokens is not None and self.in_flight and self.queued_tokens + tokens > max_tokens:
            reason = (f"{self.queued_tokens} tokens queued + {tokens} of this request > {max_tokens} "
                      "(max queued tokens)")
        else:
            self.in_flight += count
            self.queued_tokens += tokens
            self.pending_output_tokens += sum(m for _, m in sequences)
            return [Seat(p + m, m) for p, m in sequences]
        raise Overloaded(f"model is overloaded: {reason}", self.retry_after())

    def generated(self, seat: Seat, tokens: int = 1) -> None:
        spent = min(tokens, seat.unspent)
        seat.unspent -= spent
        self.pending_output_tokens -= spent
        self.rate.add(tokens)

    def release(self, seat: Seat) -> None:
        """Give a seat back; a seat already given back is left as it is."""
        if seat.released:
            return
        seat.released = True
        self.in_flight -= 1
        self.queued_tokens -= seat.tokens
        self.pending_output_tokens -= seat.unspent

    def retry_after(self) -> int:
        return retry_after_seconds(self.pending_output_tokens, self.rate.per_second())
