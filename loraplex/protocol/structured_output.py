"""Structured output as each API asks for it, turned into the engine's one `GrammarSpec`.

OpenAI routes (chat and completions): `response_format` {"type": "text" | "json_object" | "json_schema"} with
`json_schema: {"name", "schema", "strict"}` (OpenAI) or `schema` beside the type (LoRAX's form); vLLM's
`guided_json`, `guided_regex`, `guided_choice` and `structured_outputs: {"json" | "regex" | "choice" |
"json_object"}`. Native routes: `parameters.response_format` in the same shapes (LoRAX: `{"type":
"json_object", "schema": {...}}`, the schema optional). At most one constraint per request.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.params import GrammarSpec
from loraplex.protocol.errors import Unsupported

# vLLM's structured_outputs keys we serve, and the grammar kind each becomes.
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "json_object": "json_object"}

Constraint = tuple[str, GrammarSpec]  # (the field that asked, its grammar)


def schema_spec(schema: Any, where: str) -> GrammarSpec:
    """A JSON schema (an object, or its JSON text) as a grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise Unsupported(f"{where} is not valid JSON: {exc}", where) from exc
    if not isinstance(schema, (dict, bool)):
        raise Unsupported(f"{where} must be a JSON schema (an object); got {type(schema).__name__}", where)
    return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def response_format_spec(fmt: dict[str, Any] | None, where: str = "response_format") -> GrammarSpec | None:
    """`response_format` (None and {"type": "text"}: no constraint)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        return GrammarSpec("json_object", "") if schema is None else schema_spec(schema, f"{where}.schema")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if isinstance(inner, dict) and inner.get("schema") is not None:
            return schema_spec(inner["schema"], f"{where}.json_schema.schema")
        if fmt.get("schema") is not None:
            return schema_spec(fmt["schema"], f"{where}.schema")
        raise Unsupported(f"{where} of type json_schema needs its schema (json_schema.schema)", where)
    raise Unsupported(f"{where}.type must be text, json_object or json_schema; got {kind!r}", f"{where}.type")


def structured_outputs_specs(options: dict[str, Any] | None) -> list[Constraint]:
    """vLLM's `structured_outputs`: one constraint per key given."""
    found = []
    for key, value in (options or {}).items():
        if value is None or value is False:
            continue
        where = f"structured_outputs.{key}"
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise Unsupported(f"{where} is not supported; give one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}", where)
        found.append((where, _spec(STRUCTURED_OUTPUTS_KEYS[key], value, where)))
    return found


def guided_specs(json_schema: Any, regex: str | None, choice: list[str] | None) -> list[Constraint]:
    """vLLM's `guided_json`, `guided_regex`, `guided_choice`."""
    given = (("guided_json", "json_schema", json_schema), ("guided_regex", "regex", regex), ("guided_choice", "choice", choice))
    return [(where, _spec(kind, value, where)) for where, kind, value in given if value is not None]


def _spec(kind: str, value: Any, where: str) -> GrammarSpec:
    if kind == "json_schema":
        return schema_spec(value, where)
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "regex":
        if not isinstance(value, str):
            raise Unsupported(f"{where} must be a regular expression (a string)", where)
        return GrammarSpec("regex", value)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise Unsupported(f"{where} must be a non-empty list of strings", where)
    return GrammarSpec("choice", json.dumps(value, ensure_ascii=False))


def one_constraint(constraints: list[Constraint]) -> Constraint | None:
    """The request's constraint: none, or exactly one (two at once cannot both hold)."""
    if len(constraints) > 1:
        names = ", ".join(where for where, _ in constraints)
        raise Unsupported(f"give at most one output constraint; got {len(constraints)}: {names}", constraints[1][0])
    return constraints[0] if constraints else None
