import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models: a second intra-op thread gains nothing and spin-waits on a shared CPU (see test_peft_parity)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
