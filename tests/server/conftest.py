"""A server shared by the structured output and tool call tests (one model load for both files)."""

from __future__ import annotations

import pytest

from tests.helpers import live_server

GRAMMAR_BYTES = 16384  # lowered from the default (64 KiB) so that the limit's test stays small


@pytest.fixture(scope="session")
def grammar_server():
    with live_server("--max-batch-total-tokens", "8192", "--max-concurrent-requests", "16",
                     "--max-grammar-bytes", str(GRAMMAR_BYTES)) as url:
        yield url
