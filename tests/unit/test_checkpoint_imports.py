"""Checkpoint reading and quantization sit below the engine (DESIGN.md §2): they import nothing above them, and
checkpoints reach the shipped example models only through the resolvers those register, never by importing them.
The environment switches import nothing of loraplex, so every layer may read them."""

from tests.unit.test_import_rules import ROOT, loraplex_imports

ABOVE_CHECKPOINTS = {"cli", "server", "protocol", "engine", "models", "lora", "layers", "example_models"}


def test_checkpoints_and_quantization_import_nothing_above_them():
    offences = []
    for package in ("checkpoints", "quantization"):
        for path in (ROOT / package).rglob("*.py"):
            bad = loraplex_imports(path) & ABOVE_CHECKPOINTS
            if bad:
                offences.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offences, offences


def test_environment_imports_nothing_of_loraplex():
    assert loraplex_imports(ROOT / "environment.py") == set()
