"""Speculative decoding on the embedded SmolLM2 with the shipped adapters: every output (tokens, text, finish
reason, logprobs) is the one decoding without drafts gives, greedy and seeded, in mixed batches, across stops
inside accepted drafts, preemption, grammars and streaming; and drafts were really accepted each time."""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import re

import pytest

import torch

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.sampling.grammar_masks import apply_grammar_masks, apply_masks
from loraplex.engine.sampling.speculative import drafts_within_grammar
from loraplex.lora.sources.store import AdapterStore
from loraplex.params import GrammarSpec, SamplingParams
from loraplex.server.metrics import Metrics
from tests.engine.speculation import StepLog, run_to_end
from tests.models.conftest import one_thread  # noqa: F401 — the fixture, for usefixtures below
from tests.helpers import metric_value

pytestmark = pytest.mark.usefixtures("one_thread")

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
LIGHTHOUSE = ("Repeat this text exactly: The old lighthouse keeper climbed the stairs every night to light the lamp "
              "for the ships at sea.")
BAKER = "Repeat this text exactly: Rain fell on the quiet town as the baker opened his shop to the first customers."
SPEC = 4


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


@pytest.fixture(scope="module")
def adapters(embedded):
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    shapes = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=256)).lora.base_shapes
    store = AdapterStore(shapes, 64, roots=[ADAPTERS], default_source="local")
    try:
        return {name: store.load(name) for name in ("name-nova", "style-caps")}
    finally:
        store.close()


def same_outputs(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.generated_text, g.finish_reason) == (w.token_ids, w.generated_text, w.finish_reason)


SEEDED = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_mixed_batch_with_adapters_matches_decoding_without_drafts(make_engine, embedded, adapters, sampling):
    """Copying requests on the base model and two adapters, a question beside them, and two requests arriving
    mid-way (their prompts prefilled beside verification rows; one asks for logprobs)."""
    tok = embedded.tokenizer
    params = [SamplingParams(max_new_tokens=24, seed=11 + i, **sampling) for i in range(6)]
    params[5] = SamplingParams(max_new_tokens=12, seed=5, top_n_tokens=2, prompt_logprobs=True, **sampling)
    nova, caps = adapters["name-nova"], adapters["style-caps"]
    prompts = [chat(tok, t) for t in (LIGHTHOUSE, BAKER, LIGHTHOUSE, "What is your name?", BAKER, LIGHTHOUSE)]
    jobs = list(zip(prompts, params, [None, nova, caps, nova, None, caps]))
    want = run_to_end(make_engine(), jobs, late=2)
    engine = make_engine(speculative_tokens=SPEC)
    log = StepLog(engine)
    got = run_to_end(engine, jobs, late=2)
    same_outputs(got, want)
    assert engine.spec_decode.accepted_tokens > 0 and log.mixed_steps > 0
    assert {v.adapter_id for step in log.steps for v in step if v.num_drafts and len(v.kept) > 1} >= {None, "name-nova"}
    # Logprobs, of the kept tokens and of the prompt, as without drafts (computed in other rows: close, not equal).
    g, w = got[5], want[5]
    assert [t.logprob for t in g.prompt_tokens[1:]] == pytest.approx([t.logprob for t in w.prompt_tokens[1:]], abs=1e-4)
    assert engine.scheduler.allocator.num_used == 0


def test_stops_inside_accepted_drafts_end_where_decoding_without_drafts_ends(make_engine, embedded):
    """EOS (the copy ends as the prompt did, so EOS and what followed it in the prompt are drafted), a stop
    string and a stop token id, each hit in a step that verified drafts (tokens kept after a stop are dropped), and
    max_new_tokens (drafts never reach past it)."""
    tok = embedded.tokenizer
    ids = chat(tok, LIGHTHOUSE)
    (free,) = make_engine().generate([ids], SamplingParams(max_new_tokens=40))
    assert free.finish_reason.value == "eos_token" and "lighthouse keeper" in free.generated_text
    middle = free.token_ids[len(free.token_ids) // 2]
    assert free.token_ids.count(middle) == 1
    variants = [
        SamplingParams(max_new_tokens=40),
        SamplingParams(max_new_tokens=40, stop=("stairs every",)),
        SamplingParams(max_new_tokens=40, stop_token_ids=(middle,)),
        SamplingParams(max_new_tokens=9),
    ]
    want = make_engine().generate([ids] * len(variants), variants)
    engine = make_engine(speculative_tokens=SPEC)
    log = StepLog(engine)
    got = engine.generate([ids] * len(variants), variants)
    same_outputs(got, want)
    assert [o.finish_reason.value for o in got] == ["eos_token", "stop_sequence", "eos_token", "length"]
    assert got[1].generated_text.endswith("climbed the ")
    discarded = 0
    for out in got[:3]:  # each stop came in a step that verified drafts
        last = log.last_of(out.request_id)
        assert last.num_drafts > 0, last
        discarded += len(last.kept) - 1 - last.kept.index(out.token_ids[-1])
    assert discarded > 0, "some stop should fall before tokens the step kept (and must drop)"
    assert engine.scheduler.allocator.num_used == 0


def test_preemption_with_drafts_in_flight(make_engine, embedded):
    """Four copying requests outgrow a 96-slot cache (6 blocks) while verifying drafts: preempted ones drop their
    drafts, are recomputed, and end as decoding without drafts ends; no block is leaked."""
    tok = embedded.tokenizer
    texts = ["Copy: the cat sat on the mat and the cat sat on the mat and the dog",
             "Copy: one two three four five one two three four five one two",
             "Copy: red green blue red green blue red green blue red",
             "Copy: up down left right up down left right up down"]
    prompts = [tok.encode(t) for t in texts]
    plist = [SamplingParams(max_new_tokens=28, ignore_eos=True)] * len(prompts)
    want = make_engine().generate(prompts, plist)
    engine = make_engine(speculative_tokens=SPEC, max_batch_total_tokens=96)
    dropped = []
    preempt = engine.scheduler._preempt

    def observed(request):
        dropped.append(len(request.draft_ids))
        return preempt(request)

    engine.scheduler._preempt = observed
    same_outputs(engine.generate(prompts, plist), want)
    assert any(dropped), f"no preemption with drafts in flight: {dropped}"
    assert engine.spec_decode.accepted_tokens > 0
    assert engine.scheduler.allocator.num_used == 0


def test_grammar_rows_are_masked_after_their_drafts(make_engine, embedded):
    """A JSON schema: row j of a request is masked with the grammar state after drafts[:j]."""
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}, "sea": {"type": "string"}},
                         "required": ["city", "sea"]})
    text = 'Repeat this JSON exactly: {"city": "Lisbon by the river", "sea": "the wide Atlantic Ocean"}'
    ids = chat(embedded.tokenizer, text)
    params = SamplingParams(max_new_tokens=40, grammar=GrammarSpec("json_schema", schema))
    (want,) = make_engine().generate([ids], params)
    engine = make_engine(speculative_tokens=SPEC)
    (got,) = engine.generate([ids], params)
    same_outputs([got], [want])
    assert re.fullmatch(r'\{\s*"city": ".*", "sea": ".*"\s*\}', got.generated_text.strip())
    assert engine.spec_decode.accepted_tokens > 0
    # The masks themselves: each row's equals the mask of a matcher that took the drafts before it.
    matcher = engine.inputs.grammars.matcher(params.grammar)
    drafts = got.token_ids[:6]
    assert drafts_within_grammar(matcher, drafts) == drafts
    vocab = engine.model_config.vocab_size
    masked = torch.zeros(len(drafts) + 1, vocab)
    apply_grammar_masks(masked, [matcher], [drafts])
    ahead = matcher.deep_copy()
    for j, row in enumerate(masked):
        alone = torch.zeros(1, vocab)
        apply_masks(alone, [ahead])
        assert torch.equal(row, alone[0]) and row.isinf().any()
        if j < len(drafts):
            ahead.consume_token(drafts[j])
    assert not torch.equal(masked[0], masked[1])


def test_streams_every_kept_token_in_order_and_counts_in_metrics(make_engine, embedded):
    ids = chat(embedded.tokenizer, BAKER)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    (want,) = make_engine().generate([ids], params)
    engine = make_engine(speculative_tokens=SPEC)
    async_engine = AsyncEngine(engine)
    try:
        async def stream():
            return [out async for out in async_engine.generate(ids, params)]

        outs = asyncio.run(stream())
    finally:
        async_engine.shutdown()
    assert [o.token.id for o in outs] == want.token_ids
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.token.text for o in outs) == want.generated_text
    drafted, accepted = engine.spec_decode.draft_tokens, engine.spec_decode.accepted_tokens
    assert 0 < accepted <= drafted
    metrics = Metrics(engine.model_id, engine.stats).exposition().decode()
    for name, value in [("loraplex_spec_decode_draft_tokens_total", drafted),
                        ("loraplex_spec_decode_accepted_tokens_total", accepted),
                        ("vllm:spec_decode_num_draft_tokens_total", drafted),
                        ("vllm:spec_decode_num_accepted_tokens_total", accepted)]:
        assert math.isclose(metric_value(metrics, name), value)
