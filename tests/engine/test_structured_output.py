"""Structured output in the engine (llguidance grammars) on the embedded SmolLM2: outputs match their JSON schema,
regex or choice list, greedy and sampled; unconstrained requests in the same batch give what they give alone;
a grammar that cannot be used is refused naming the problem; a request cut by max_new_tokens inside its
grammar ends with finish reason length."""

from __future__ import annotations

import json
import re

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.requests.request import RequestRefused
from loraplex.params import FinishReason, GrammarSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                   "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_config(EngineConfig(max_batch_total_tokens=8192))


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def finals(engine, requests) -> dict:
    out = {}
    while engine.has_unfinished:
        for o in engine.step():
            assert o.error is None, o.error
            if o.finished:
                out[o.request_id] = o
    return {r.request_id: out[r.request_id] for r in requests}


def check_schema(value: dict) -> None:
    assert set(value) == {"name", "age", "colour"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12 and isinstance(value["age"], int)
    assert value["colour"] in ("red", "green", "blue")


def test_outputs_match_their_grammars_next_to_unconstrained_requests(engine):
    ask = prompt(engine, "Describe a person as JSON.")
    free = prompt(engine, "Write a haiku about the sea.")
    specs = {
        "schema greedy": (GrammarSpec("json_schema", json.dumps(SCHEMA)), {}),
        "schema sampled": (GrammarSpec("json_schema", json.dumps(SCHEMA)), dict(do_sample=True, temperature=1.0, seed=3)),
        "object": (GrammarSpec("json_object", ""), dict(max_new_tokens=120)),
        "regex": (GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"), {}),
        "choice": (GrammarSpec("choice", json.dumps(["yes", "no", "maybe"])), dict(do_sample=True, seed=1)),
    }
    alone = engine.generate([free], SamplingParams(max_new_tokens=24))[0].token_ids
    short = prompt(engine, 'What is 2 + 2? Answer as JSON: {"answer": <the number>}.')
    requests = {name: engine.add_request(short if name == "object" else ask,
                                         SamplingParams(**{"max_new_tokens": 60, **kw}, grammar=spec))
                for name, (spec, kw) in specs.items()}
    unconstrained = engine.add_request(free, SamplingParams(max_new_tokens=24))
    out = finals(engine, [*requests.values(), unconstrained])
    text = {name: out[r.request_id].generated_text for name, r in requests.items()}
    for name in ("schema greedy", "schema sampled"):
        check_schema(json.loads(text[name]))
        assert out[requests[name].request_id].finish_reason is FinishReason.EOS_TOKEN
    assert isinstance(json.loads(text["object"]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text["regex"]), text["regex"]
    assert text["choice"] in ("yes", "no", "maybe")
    assert out[unconstrained.request_id].token_ids == alone  # masks touch only their own rows
    assert engine.scheduler.allocator.num_used == 0


def test_unusable_grammars_are_refused_naming_the_problem(engine):
    ids = prompt(engine, "hi")
    cases = {
        GrammarSpec("json_schema", json.dumps({"type": "objectx"})): "objectx",
        GrammarSpec("json_schema", "{not json"): "json_schema",
        GrammarSpec("regex", "(unclosed"): "regex",
        GrammarSpec("choice", "[]"): "non-empty list",
        GrammarSpec("yaml", ""): "unknown grammar kind",
    }
    for spec, words in cases.items():
        with pytest.raises(RequestRefused, match=re.escape(words)):
            engine.add_request(ids, SamplingParams(max_new_tokens=4, grammar=spec))
    assert not engine.has_unfinished


def test_max_tokens_inside_the_grammar_is_a_length_finish(engine):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    out = engine.generate([prompt(engine, "Describe a person as JSON.")], SamplingParams(max_new_tokens=5, grammar=spec))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5
    assert out.generated_text.startswith("{")
