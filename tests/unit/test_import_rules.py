"""The tree's rules (DESIGN.md §2), kept by tests: imports go down only (cli -> server -> protocol -> engine -> models
-> layers; lora beside layers; checkpoints, quantization below the engine), LoRA kernels import nothing from layers/,
the server never reaches into the engine's parts, no import circle, no product file over 500 lines."""

from __future__ import annotations

import ast
import pathlib

import benchmarks
import loraplex

ROOT = pathlib.Path(loraplex.__file__).parent
BENCHMARKS = pathlib.Path(benchmarks.__file__).parent
MAX_LINES = 500

# The packages and top-level modules above the engine, and the engine itself.
ABOVE_MODELS = {"engine", "server", "protocol", "cli"}
# package or top-level module -> loraplex packages and modules it must never import
FORBIDDEN = {
    "models": ABOVE_MODELS | {"lora", "quantization"},
    "layers": ABOVE_MODELS | {"models", "lora", "checkpoints", "quantization", "example_models"},
    "lora": ABOVE_MODELS | {"models", "example_models"},
    "quantization": ABOVE_MODELS | {"models", "lora", "layers", "example_models"},
    "checkpoints": ABOVE_MODELS | {"models", "lora", "layers", "quantization", "example_models"},
    "kernels": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models"},
    "engine": {"server", "protocol", "cli"},
    "protocol": {"server", "cli"},
    "server": {"cli"},
    "multimodal": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models"},
    # the loose modules at the top
    "config": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models"},
    "params": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models"},
    "environment": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models"},
    "tokenizer": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models"},
    "settings": ABOVE_MODELS | {"models", "lora", "layers", "checkpoints", "quantization", "example_models",
                                "config", "params", "multimodal"},
}


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package at `root`."""
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_modules(path: pathlib.Path, package: str, tops: tuple[str, ...] = ("loraplex",)) -> set[str]:
    """Every module of the packages `tops` that `path` imports (absolute or relative, at the top or inside a
    function), dotted."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] in tops}


def top_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def import_graph(roots: tuple[pathlib.Path, ...] = (ROOT,)) -> dict[str, set[str]]:
    """Module -> the modules it imports, over the packages at `roots` (the import rules' default: loraplex)."""
    files = {name: path for root in roots for name, path in module_files(root).items()}
    tops = tuple(root.name for root in roots)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = {known(n) for n in imported_modules(path, package, tops)}
        graph[module] = {d for d in deps if d and d != module and d not in tops}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_imports_go_down_only():
    offences = []
    for module, deps in import_graph().items():
        forbidden = FORBIDDEN.get(top_part(module) or "", set())
        bad = {top_part(d) for d in deps} & forbidden
        if bad:
            offences.append(f"{module} imports {sorted(bad)}")
    assert not offences, offences


def test_lora_kernels_import_nothing_from_layers():
    offences = [f"{m} imports {sorted(d for d in deps if top_part(d) == 'layers')}"
                for m, deps in import_graph().items()
                if m.startswith("loraplex.lora.step.kernels") and any(top_part(d) == "layers" for d in deps)]
    assert not offences, offences


def test_no_import_circles():
    assert import_circles(import_graph()) == []


ENGINE_PARTS = {"core", "runner", "scheduler", "lora", "allocator", "slots"}
# What the server may import of the engine: the facade, its description and stats, outputs and refusals.
SERVER_MAY_IMPORT = {"loraplex.engine.async_engine", "loraplex.engine.served_model", "loraplex.engine.stats",
                     "loraplex.engine.requests.output", "loraplex.engine.requests.request", "loraplex.engine.requests.inputs"}


def reaches_into_engine(path: pathlib.Path) -> list[str]:
    """What a server file may not name: the synchronous `Engine` (as a name, or as `<x>.engine.engine`, the
    AsyncEngine's handle on it), and the engine's parts (`.core`, `.runner`, `.scheduler`, `.lora`, ...) on
    a name or attribute called `engine`, `core` or `state`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id == "Engine":
            found.append(f"{path.name}:{node.lineno} Engine")
        elif isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] == "Engine":
            found.append(f"{path.name}:{getattr(node, 'lineno', '?')} Engine")
        elif isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS | {"engine"}:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if (node.attr == "engine" and name == "engine") or (node.attr != "engine" and name in ("engine", "core", "state")):
                found.append(f"{path.name}:{node.lineno} .{name}.{node.attr}")
    return found


def server_imports_of_engine_internals(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith("loraplex.server")
            for d in sorted(deps) if d.startswith("loraplex.engine.") and d not in SERVER_MAY_IMPORT]


def test_the_server_never_reaches_into_the_engine():
    offences = [hit for path in (ROOT / "server").rglob("*.py") for hit in reaches_into_engine(path)]
    offences += server_imports_of_engine_internals(import_graph())
    assert not offences, offences


def test_no_product_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_circle_over_loraplex_and_the_benchmarks():
    """The benchmarks import loraplex, and loraplex's `bench` command imports benchmarks.offline: one graph over both
    packages (imports inside functions and `__main__` blocks included) has no circle, within either or across
    (benchmarks/systems.py holds what offline.py and seq2seq.py share)."""
    graph = import_graph((ROOT, BENCHMARKS))
    assert {"benchmarks.seq2seq", "benchmarks.systems", "loraplex.engine.engine"} <= graph["benchmarks.offline"]
    assert import_circles(graph) == []


def test_no_benchmark_file_over_500_lines():
    long = {str(p.relative_to(BENCHMARKS)): n for p in BENCHMARKS.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


# ---- the checkers themselves see what they look for ---------------------------------------------------------------


def test_the_import_reader_sees_absolute_relative_and_local_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import loraplex.engine.worker.runner\nfrom loraplex.server.app import create_app\n"
                      "def f():\n    from ..lora import plan\n")
    found = imported_modules(module, "loraplex.engine")
    assert {"loraplex.engine.worker.runner", "loraplex.server.app", "loraplex.lora.plan"} <= found
    assert {top_part(n) for n in found} == {"engine", "server", "lora"}


def test_the_circle_finder_finds_a_circle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_engine_reach_checker_sees_a_reach(tmp_path):
    module = tmp_path / "server_module.py"
    module.write_text("from loraplex.engine.engine import Engine\n"
                      "def f(state, engine: 'x'):\n    return state.core.runner.model, engine.scheduler.waiting, state.config, "
                      "state.engine.engine, state.model.tokenizer, Engine\n")
    hits = [hit.split(" ")[1] for hit in reaches_into_engine(module)]
    assert sorted(hits) == sorted(["Engine", "Engine", ".state.core", ".core.runner", ".engine.scheduler", ".engine.engine"])


def test_the_server_import_rule_sees_an_engine_internal():
    graph = {"loraplex.server.x": {"loraplex.engine.scheduling.scheduler", "loraplex.engine.async_engine", "loraplex.engine.engine"},
             "loraplex.protocol.y": {"loraplex.engine.scheduling.scheduler"}}
    assert server_imports_of_engine_internals(graph) == [
        "loraplex.server.x imports loraplex.engine.engine", "loraplex.server.x imports loraplex.engine.scheduling.scheduler"
    ]
