"""DecodeBudget: bytes of decoded images that may exist at once, server-wide (an asyncio byte semaphore).

A request reserves the decoded size of all its images before any is decoded and keeps the reservation
until its images have been processed; requests that do not fit wait their turn, first come first
served (a large request is not starved by a stream of small ones). Only the event loop touches it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class DecodeBudget:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0  # the most ever reserved at once (metrics, tests)
        self.waits = 0  # reservations that had to wait for others to finish
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for _, future in self._waiters if not future.done())

    async def acquire(self, size: int) -> None:
        """Reserve `size` bytes, waiting while others hold the budget. `size` must fit the capacity."""
        if size > self.capacity:
            raise ValueError(f"{size} bytes can never fit a budget of {self.capacity}")
        if not self._waiters and self.in_use + size <= self.capacity:
            self._take(size)
            return
        future = asyncio.get_running_loop().create_future()
        entry = (size, future)
        self._waiters.append(entry)
        self.waits += 1
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled before it resumed
                self.release(size)
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self._wake()  # it may have been the head blocking smaller requests behind it
            raise

    def release(self, size: int) -> None:
        self.in_use -= size
        self._wake()

    @asynccontextmanager
    async def reserved(self, size: int) -> AsyncIterator[None]:
        await self.acquire(size)
        try:
            yield
        finally:
            self.release(size)

    def _take(self, size: int) -> None:
        self.in_use += size
        self.peak = max(self.peak, self.in_use)

    def _wake(self) -> None:
        while self._waiters:
            size, future = self._waiters[0]
            if future.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if self.in_use + size > self.capacity:
                return  # first come first served: the head waits, and so does everyone behind it
            self._waiters.popleft()
            self._take(size)
            future.set_result(None)
