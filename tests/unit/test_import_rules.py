"""Imports go down only (DESIGN.md §2): cli -> server -> protocol -> engine -> models -> layers; lora beside layers."""

import ast
import pathlib

import loraplex

ROOT = pathlib.Path(loraplex.__file__).parent

# package -> loraplex packages it must never import
FORBIDDEN = {
    "models": {"engine", "server", "protocol", "cli", "lora"},
    "layers": {"engine", "server", "protocol", "cli", "models", "lora"},
    "lora": {"engine", "server", "protocol", "cli", "models"},
    "engine": {"server", "protocol", "cli"},
    "protocol": {"server", "cli"},
    "server": {"cli"},
    "multimodal": {"engine", "server", "protocol", "cli", "models", "lora", "layers"},
}


def loraplex_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n.split(".")[1] for n in names if n.startswith("loraplex.") and n.count(".") >= 1}


def test_imports_go_down_only():
    offences = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            bad = loraplex_imports(path) & forbidden
            if bad:
                offences.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offences, offences


def test_the_rule_checker_sees_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import loraplex.engine.runner\nfrom loraplex.server.app import create_app\n")
    assert loraplex_imports(module) == {"engine", "server"}
