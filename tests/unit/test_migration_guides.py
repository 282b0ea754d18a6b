"""docs/coming-from-lorax.md and docs/coming-from-vllm.md stay true: every flag, route and metric they name as ours
(the `ours` and `status` columns of their `theirs | ours | status` tables, and their prose outside code blocks) is one
`loraplex serve` takes, one the app serves and one /metrics writes; every request field named as ours is one the
request models take. A flag, route, metric or field that disappears fails here, naming the guide and the row."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from starlette.routing import Match

from loraplex.cli import build_parser
from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.protocol.native import CompatGenerateRequest, GenerateParameters, GenerateRequest
from loraplex.protocol.openai import ChatCompletionRequest, CompletionRequest
from loraplex.server import metrics as metrics_module
from loraplex.server.app import create_app
from tests.helpers import asgi_calls

ROOT = Path(__file__).resolve().parents[2]
GUIDES = {"lorax": ROOT / "docs" / "coming-from-lorax.md", "vllm": ROOT / "docs" / "coming-from-vllm.md"}
SECTIONS = ("flags", "routes", "request fields", "metrics")  # each guide's tables, by the words of their heading
STATUSES = ("same", "renamed", "not served")
# Request fields the guides may name as ours: the native body and its parameters; the OpenAI routes' bodies.
FIELDS = {
    "lorax": set(GenerateParameters.model_fields) | set(GenerateRequest.model_fields)
    | set(CompatGenerateRequest.model_fields),
    "vllm": set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields),
}

SPAN = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
ROUTE = re.compile(r"\b(GET|POST|HEAD|PUT|PATCH|DELETE) (/[^\s`,]*)")
METRIC = re.compile(r"(?:lorax_|loraplex_|vllm:)[a-z0-9_:]+")
FIELD = re.compile(r"[a-z][a-z0-9_]*")


def _spans(text: str) -> list[str]:
    return SPAN.findall(text)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse(text: str):
    """The guide's tables, as {section: [(theirs, ours, status), ...]} (a section: the `##` heading above the table,
    lower-cased), and its prose outside tables and code blocks."""
    tables: dict[str, list[tuple[str, str, str]]] = {}
    prose: list[str] = []
    heading, in_code, header_seen = "", False, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("## "):
            heading, header_seen = line[3:].strip().lower(), False
            continue
        if line.startswith("|"):
            cells = _cells(line)
            if cells == ["theirs", "ours", "status"]:
                header_seen = True
                tables.setdefault(heading, [])
                continue
            if set(line.replace("|", "").strip()) <= {"-", ":", " "}:
                continue
            assert header_seen, f"a table row under {heading!r} without the `theirs | ours | status` header: {line}"
            assert len(cells) == 3, f"{heading!r}: a row needs 3 cells (no `|` inside one): {line}"
            tables[heading].append((cells[0], cells[1], cells[2]))
        else:
            prose.append(line)
    return tables, "\n".join(prose)


def _section(tables: dict, words: str) -> list[tuple[str, str, str]]:
    found = [rows for heading, rows in tables.items() if heading.startswith(words) or f" {words}" in heading]
    assert len(found) == 1, f"one table under a heading with {words!r}: {sorted(tables)}"
    return found[0]


def _named(text: str) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """The flags, (method, path) routes and metric names in `text`'s backticked spans."""
    flags, routes, metrics = set(), set(), set()
    for span in _spans(text):
        if "*" in span:  # `lorax_*`: a family, not a name
            continue
        flags.update(FLAG.findall(span))
        routes.update(ROUTE.findall(span))
        if METRIC.fullmatch(span):
            metrics.add(span)
    return flags, routes, metrics


@pytest.fixture(scope="module")
def serve_flags() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {flag for action in sub.choices["serve"]._actions for flag in action.option_strings}


@pytest.fixture(scope="module")
def app(embedded):
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=1024)))
    try:
        yield create_app(engine, ServerConfig())
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def exposition(app) -> str:
    (response,) = asgi_calls(app, ("GET", "/metrics", None))
    assert response.status_code == 200
    return response.text


def _served(app, method: str, path: str) -> bool:
    path = re.sub(r"\{[^}]*\}", "some-name", path)  # a path parameter: any value
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "path_params": {}, "headers": [],
             "query_string": b""}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)


def _written(name: str, exposition: str) -> bool:
    """/metrics has the family: its TYPE line (a counter's name may or may not carry `_total` there)."""
    bare = name.removesuffix("_total")
    return any(f"# TYPE {n} " in exposition for n in (name, bare, f"{bare}_total"))


def _in_source(name: str, source: str) -> bool:
    """metrics.py names it (a counter is declared without the `_total` the exposition adds)."""
    return f'"{name}"' in source or f'"{name.removesuffix("_total")}"' in source


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_tables_are_well_formed(guide):
    tables, _ = parse(GUIDES[guide].read_text())
    for words in SECTIONS:
        rows = _section(tables, words)
        assert len(rows) >= 5, f"{guide}: {words} has {len(rows)} rows"
        for theirs, ours, status in rows:
            assert theirs and theirs != "—", f"{guide}: a {words} row names nothing of theirs: {ours} | {status}"
            assert status.startswith(STATUSES), f"{guide}: {theirs}: status {status!r} is none of {STATUSES}"
            if status.startswith("not served"):
                assert ours == "—", f"{guide}: {theirs} is not served, yet names {ours!r} as ours"
                assert re.match(r"not served\S* \S", status), \
                    f"{guide}: {theirs}: say in a few words why it is not served or what to use"
            else:
                assert ours != "—" and _spans(ours), f"{guide}: {theirs} is {status.split()[0]}, with nothing as ours"


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_flags_are_serve_flags(guide, serve_flags):
    tables, prose = parse(GUIDES[guide].read_text())
    rows = _section(tables, "flags")
    for theirs, ours, status in rows:
        if not status.startswith("not served"):
            assert _named(ours)[0], f"{guide}: {theirs}: its `ours` cell names no flag"
    named = {}  # flag -> where the guide names it
    for words in SECTIONS:
        for theirs, ours, status in _section(tables, words):
            for flag in _named(ours)[0] | _named(status)[0]:
                named.setdefault(flag, f"{words}: {theirs}")
    for flag in _named(prose)[0]:
        named.setdefault(flag, "prose")
    assert len(named) >= 20
    missing = {flag: where for flag, where in named.items() if flag not in serve_flags}
    assert not missing, f"{guide} names flags `loraplex serve` does not take: {missing}"


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_routes_are_served(guide, app):
    tables, prose = parse(GUIDES[guide].read_text())
    named = {}
    for theirs, ours, status in _section(tables, "routes"):
        routes = _named(ours)[1]
        if not status.startswith("not served"):
            assert routes, f"{guide}: {theirs}: its `ours` cell names no route"
    for words in SECTIONS:
        for theirs, ours, status in _section(tables, words):
            for route in _named(ours)[1] | _named(status)[1]:
                named.setdefault(route, f"{words}: {theirs}")
    for route in _named(prose)[1]:
        named.setdefault(route, "prose")
    assert len(named) >= 10
    missing = {f"{m} {p}": where for (m, p), where in named.items() if not _served(app, m, p)}
    assert not missing, f"{guide} names routes the app does not serve: {missing}"


def test_the_checks_can_fail(app, serve_flags, exposition):
    """A route the app lacks, or a method it does not take there, a flag serve lacks and a series /metrics lacks are
    all told apart from those it has."""
    assert _served(app, "GET", "/health") and _served(app, "GET", "/v1/models/{model_id}")
    assert not _served(app, "POST", "/classify") and not _served(app, "GET", "/generate")
    assert "--max-active-adapters" in serve_flags and "--num-shard" not in serve_flags
    assert _written("vllm:prompt_tokens_total", exposition) and _written("lorax_request_count", exposition)
    assert not _written("vllm:request_params_n", exposition)
    source = Path(metrics_module.__file__).read_text()
    assert _in_source("vllm:prompt_tokens_total", source) and not _in_source("lorax_batch_concat", source)


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_metrics_are_written(guide, exposition):
    tables, prose = parse(GUIDES[guide].read_text())
    source = Path(metrics_module.__file__).read_text()
    named = {}
    for theirs, ours, status in _section(tables, "metrics"):
        if not status.startswith("not served"):
            assert _named(ours)[2], f"{guide}: {theirs}: its `ours` cell names no metric"
    for words in SECTIONS:
        for theirs, ours, status in _section(tables, words):
            for metric in _named(ours)[2] | _named(status)[2]:
                named.setdefault(metric, f"{words}: {theirs}")
    for metric in _named(prose)[2]:
        named.setdefault(metric, "prose")
    assert len(named) >= 15
    not_declared = {m: where for m, where in named.items() if not _in_source(m, source)}
    assert not not_declared, f"{guide} names metrics loraplex/server/metrics.py does not declare: {not_declared}"
    not_written = {m: where for m, where in named.items() if not _written(m, exposition)}
    assert not not_written, f"{guide} names metrics GET /metrics does not write: {not_written}"


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_request_fields_are_taken(guide):
    tables, _ = parse(GUIDES[guide].read_text())
    missing = {}
    for theirs, ours, status in _section(tables, "request fields"):
        if status.startswith("not served"):
            continue
        fields = [span for span in _spans(ours) if FIELD.fullmatch(span)]
        assert fields, f"{guide}: {theirs}: its `ours` cell names no field"
        for field in fields:
            if field not in FIELDS[guide]:
                missing[field] = theirs
    assert not missing, f"{guide} names request fields the request models do not take: {missing}"
