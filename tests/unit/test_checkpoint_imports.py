"""Checkpoint reading and quantization sit below the engine (DESIGN.md §2): they import nothing above them, and
checkpoints reach the shipped example models only through the resolvers those register, never by importing them.
The environment switches import nothing of loraplex, so every layer may read them."""

from tests.unit.test_import_rules import import_graph, top_part

ABOVE_CHECKPOINTS = {"cli", "server", "protocol", "engine", "models", "lora", "layers", "example_models"}


def test_checkpoints_and_quantization_import_nothing_above_them():
    offences = [f"{module} imports {sorted(bad)}" for module, deps in import_graph().items()
                if top_part(module) in ("checkpoints", "quantization")
                and (bad := {top_part(d) for d in deps} & ABOVE_CHECKPOINTS)]
    assert not offences, offences


def test_environment_imports_nothing_of_loraplex():
    assert import_graph()["loraplex.environment"] == set()
