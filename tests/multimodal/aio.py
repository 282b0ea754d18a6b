"""Run a coroutine from a plain test (the suite has no pytest-asyncio)."""

import asyncio


def run(coroutine):
    return asyncio.run(coroutine)
