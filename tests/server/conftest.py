"""Servers shared by several test files (one model load each): the structured output and tool call tests' one,
and the native and OpenAI API tests' one."""

from __future__ import annotations

import pytest

from tests.helpers import live_server

GRAMMAR_BYTES = 16384  # lowered from the default (64 KiB) so that the limit's test stays small


@pytest.fixture(scope="session")
def grammar_server():
    with live_server("--max-batch-total-tokens", "8192", "--max-concurrent-requests", "16",
                     "--max-grammar-bytes", str(GRAMMAR_BYTES)) as url:
        yield url


@pytest.fixture(scope="session")
def api_server():
    """`loraplex serve` with 8192 KV tokens and 4 concurrent requests, for test_native_server and test_openai
    (the settings both asked of their own server): every test there leaves it idle."""
    with live_server("--max-batch-total-tokens", "8192", "--max-concurrent-requests", "4") as url:
        yield url
