"""Structured output over 20 JSON schemas of varied shapes on the embedded SmolLM2, in one mixed batch:
every answer, greedy and sampled, on the base model and on a shipped adapter, is complete JSON that
validates against its schema (jsonschema), while unconstrained requests in the same batch answer as they
do alone. Schemas the engine cannot use are refused naming the problem; grammars over the limits (size,
compile time) naming the limit; and a grammar compiled at the edge is compiled once, off the engine
thread, then only copied."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import threading

import jsonschema
import pytest

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.requests.request import RequestRefused
from loraplex.params import FinishReason
from loraplex.lora.sources.store import AdapterStore
from loraplex.params import GrammarSpec, SamplingParams
from loraplex.engine.requests.grammars import Grammars

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def string(most: int) -> dict:
    return {"type": "string", "maxLength": most}


# Small bounded shapes (strings with maxLength, numbers with bounds, no extra properties), so that every
# answer completes well within its token budget.
SCHEMAS = {
    "person": obj({"name": string(12), "age": integer(0, 120)}),
    "nested": obj({"user": obj({"id": integer(1, 999), "active": {"type": "boolean"}}),
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    "integer array": {"type": "array", "items": integer(0, 100), "minItems": 2, "maxItems": 4},
    "enum": {"enum": ["red", "green", "blue"]},
    "const": obj({"version": {"const": 2}, "ok": {"type": "boolean"}}),
    "any of": {"anyOf": [integer(0, 50), string(6)]},
    "optional field": obj({"title": string(10), "subtitle": string(10)}, required=["title"]),
    "number": obj({"price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}}),
    "boolean": {"type": "boolean"},
    "array of objects": {"type": "array", "items": obj({"x": integer(0, 9), "y": integer(0, 9)}), "minItems": 1, "maxItems": 2},
    "string": string(10),
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "deep": obj({"a": obj({"b": obj({"c": integer(0, 9)})})}),
    "integer enum": obj({"level": {"enum": [1, 2, 3]}, "label": string(8)}),
    "nullable": obj({"note": {"anyOf": [string(8), {"type": "null"}]}}),
    "refs": {"$defs": {"Armor": {"enum": ["leather", "chainmail", "plate"]}},
             **obj({"name": string(10), "armor": {"$ref": "#/$defs/Armor"}, "strength": integer(1, 20)})},
    "fixed length": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    "exclusive bounds": obj({"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "status": obj({"status": {"enum": ["ok", "error"]}, "code": integer(100, 599), "retry": {"type": "boolean"}}),
    "matrix": {"type": "array", "items": {"type": "array", "items": integer(0, 9), "minItems": 2, "maxItems": 2},
               "minItems": 2, "maxItems": 2},
}
SAMPLED = dict(do_sample=True, temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def engine(embedded) -> Engine:
    return Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=16384))


@pytest.fixture(scope="module")
def caps(engine):
    store = AdapterStore(engine.lora.base_shapes, 64, roots=[ADAPTERS], default_source="local")
    try:
        return store.load("style-caps")
    finally:
        store.close()


def chat(engine: Engine, text: str) -> list[int]:
    """A short prompt (its own short system message instead of the template's default): less to prefill."""
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def test_every_answer_validates_in_a_batch_with_unconstrained_requests(engine, caps):
    ask, free = chat(engine, "Answer in JSON."), chat(engine, "Write a short poem about rivers.")
    plain = SamplingParams(max_new_tokens=16, ignore_eos=True)
    adapters = {"base": None, "caps": caps}
    alone = {name: engine.generate([free], plain, adapters=[a])[0].token_ids for name, a in adapters.items()}
    cases = [(name, adapter, kw) for name in SCHEMAS for adapter in (None, caps)
             for kw in ({}, {**SAMPLED, "seed": len(name)})]
    constrained = [engine.add_request(ask, SamplingParams(max_new_tokens=64, grammar=spec(SCHEMAS[name]), **kw), adapter=a)
                   for name, a, kw in cases]
    unconstrained = {name: engine.add_request(free, plain, adapter=a) for name, a in adapters.items()}
    finals = run(engine)
    for (name, adapter, kw), request in zip(cases, constrained):
        out = finals[request.request_id]
        where = f"{name} ({'caps' if adapter else 'base'}, {'sampled' if kw else 'greedy'}): {out.generated_text!r}"
        assert out.finish_reason is FinishReason.EOS_TOKEN, where  # the grammar completed
        jsonschema.validate(json.loads(out.generated_text), SCHEMAS[name])
    for adapter, request in unconstrained.items():
        assert finals[request.request_id].token_ids == alone[adapter]  # masks touch only their own rows
    caps_answers = [finals[r.request_id].generated_text for (_, a, _), r in zip(cases, constrained) if a is caps]
    assert any(re.search("[A-Z]{3}", text) for text in caps_answers)  # the adapter did run on constrained rows
    assert engine.scheduler.allocator.num_used == 0


def run(engine: Engine) -> dict:
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("schema, words", [
    ('{"type": "objectx"}', "objectx"),
    ('{"type": "integer", "minimum": 5, "maximum": 1}', "minimum (5) is greater than maximum (1)"),
    ('{"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}', "unsatisfiable"),
    ('{"$ref": "#/$defs/Missing"}', "Missing"),
    ('{"type": "object", "properties": 7}', "json_schema"),
    ("{not json", "json_schema"),
])
def test_unusable_schemas_are_refused_naming_the_problem(engine, schema, words):
    with pytest.raises(RequestRefused, match=re.escape(words)) as refused:
        engine.add_request(chat(engine, "hi"), SamplingParams(max_new_tokens=4, grammar=GrammarSpec("json_schema", schema)))
    assert str(refused.value).startswith("invalid grammar: json_schema")
    assert not engine.has_unfinished


def test_a_schema_over_the_size_limit_is_refused_naming_it(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=1024, max_grammar_bytes=1000))
    big = spec({"enum": [f"option number {i}" for i in range(100)]})
    with pytest.raises(RequestRefused, match=r"json_schema is \d+ bytes; must be <= 1000 \(max grammar bytes\)"):
        engine.compile_grammar(big)


def test_a_slow_compile_is_refused_naming_the_limit_and_stays_refused(embedded, monkeypatch):
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=1024, grammar_compile_timeout_s=1e-6)))
    builds = count_builds(monkeypatch)
    try:
        with pytest.raises(RequestRefused, match=r"grammar compile timeout"):
            asyncio.run(engine.compile_grammar(spec(SCHEMAS["person"])))
        with pytest.raises(RequestRefused, match=r"must be <= 1e-06 s \(grammar compile timeout\)"):
            engine.engine.compile_grammar(spec(SCHEMAS["person"]))  # waits for that compile: refused, remembered
        assert len(builds) == 1
    finally:
        engine.shutdown()


def count_builds(monkeypatch) -> list[str]:
    """Patch Grammars so that each compile records the thread it ran on."""
    threads: list[str] = []
    build = Grammars._build

    def counted(self, spec):
        threads.append(threading.current_thread().name)
        return build(self, spec)

    monkeypatch.setattr(Grammars, "_build", counted)
    return threads


def test_a_grammar_compiled_at_the_edge_is_compiled_once_off_the_engine_thread(embedded, monkeypatch):
    engine = AsyncEngine(Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=1024)))
    builds = count_builds(monkeypatch)
    schema = spec(SCHEMAS["const"])

    async def main():
        await engine.compile_grammar(schema)
        return [out async for out in engine.generate(chat(engine.engine, "JSON please."), SamplingParams(max_new_tokens=32, grammar=schema))]

    try:
        outputs = asyncio.run(main())
    finally:
        engine.shutdown()
    jsonschema.validate(json.loads(outputs[-1].generated_text), SCHEMAS["const"])
    assert len(builds) == 1 and builds[0] not in ("loraplex-engine", threading.main_thread().name)
