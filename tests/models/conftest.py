"""Fixtures for the model parity tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded machine spinning threads make every
    step many times slower: one thread for the module that asks (`pytestmark = usefixtures(...)`), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
