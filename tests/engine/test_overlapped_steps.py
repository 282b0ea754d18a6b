"""Overlapped decode steps (engine/worker/overlap.py), on the CPU's eager steps (`overlap_steps=True`; CUDA graphs take the
same path on a GPU, tests/gpu/test_gpu_decode_graphs.py): each request gets the tokens it gets alone, whatever ends
it (length, a stop token, a stop sequence) and whatever else happens while its token is being computed (requests
arriving, a sampled request joining, an abort, a preemption); placeholders never reach an output or the prefix
cache, and every KV block comes back."""

from __future__ import annotations

import pathlib

import pytest

from loraplex.engine.worker.overlap import PENDING
from loraplex.lora.sources.store import AdapterStore
from loraplex.params import SamplingParams
from tests.helpers import counting_launches

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
TEXTS = ("The capital of France is", "1, 2, 3, 4,", "Once upon a time", "Hello", "Name a colour:", "def main():")


@pytest.fixture(scope="module")
def prompts(embedded) -> list[list[int]]:
    return [embedded.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def adapters(embedded):
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    shapes = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=256)).lora.base_shapes
    store = AdapterStore(shapes, 64, roots=[ADAPTERS], default_source="local")
    try:
        return [store.load(name) for name in ("name-nova", "style-caps")]
    finally:
        store.close()


def params_mix() -> list[SamplingParams]:
    """Ends by length (1, 2, 13, 20 tokens), by a stop token, by a stop sequence."""
    return [SamplingParams(max_new_tokens=13), SamplingParams(max_new_tokens=16, stop=[" 7"]),
            SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=20, stop_token_ids=(29,)),
            SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=20)]


def finals(outputs) -> list[tuple]:
    return [(o.token_ids, o.generated_text, o.finish_reason, o.error) for o in outputs]


def check_all_back(engine) -> None:
    assert not engine.has_unfinished and engine._in_flight is None
    assert engine.scheduler.allocator.num_used == 0


def test_overlapped_steps_give_each_request_its_own_tokens(make_engine, prompts, adapters):
    params = params_mix()
    used = [None, adapters[0], None, adapters[1], adapters[0], None]
    plain = make_engine(overlap_steps=False, max_active_adapters=2)
    expected = finals(plain.generate(prompts, params, adapters=used))
    assert any(o[2] == "stop_sequence" for o in expected) and sum(len(o[0]) < 20 for o in expected) >= 4
    engine = make_engine(overlap_steps=True, max_active_adapters=2)
    counts = counting_launches(engine)
    assert finals(engine.generate(prompts, params, adapters=used)) == expected
    assert counts["chained"] >= 10, counts  # the decode steps did overlap
    check_all_back(engine)


def test_requests_arriving_or_sampling_while_a_step_is_in_flight(make_engine, prompts):
    """New prompts (prefill steps) and a penalised request (the sampler) cannot be launched ahead: the step in
    flight is read first, and the requests in it go on with the right tokens."""
    plain = SamplingParams(max_new_tokens=12)
    penalised = SamplingParams(max_new_tokens=12, repetition_penalty=1.5)
    solo_engine = make_engine(overlap_steps=False)
    solo = [solo_engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, [plain] * 4 + [penalised, plain])]
    engine = make_engine(overlap_steps=True)
    counts = counting_launches(engine)
    requests = [engine.add_request(prompts[0], plain)]
    got = {}
    for step in range(200):
        if step in (3, 5, 9):  # each arrives while the others decode
            requests.append(engine.add_request(prompts[len(requests)], plain))
        if step == 12:
            requests.append(engine.add_request(prompts[4], penalised))
            requests.append(engine.add_request(prompts[5], plain))
        got.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        if not engine.has_unfinished and step > 12:
            break
    assert [got[r.request_id] for r in requests] == solo
    assert counts["chained"] >= 5, counts
    check_all_back(engine)


def test_an_abort_while_its_token_is_computed(make_engine, prompts):
    params = SamplingParams(max_new_tokens=10)
    solo_engine = make_engine(overlap_steps=False)
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts[:3]]
    engine = make_engine(overlap_steps=True)
    requests = [engine.add_request(p, params) for p in prompts[:3]]
    streamed = {r.request_id: [] for r in requests}
    for _ in range(4):
        for out in engine.step():
            streamed[out.request_id].append(out.token.id)
    victim = requests[1]
    assert engine._in_flight is not None and victim.num_pending == 1  # its next token is being computed
    assert engine.abort_request(victim.request_id)
    assert PENDING not in victim.output_ids
    got = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id != victim.request_id, "an aborted request got a token"
            streamed[out.request_id].append(out.token.id)
            if out.finished:
                got[out.request_id] = out.token_ids
    assert [got[requests[0].request_id], got[requests[2].request_id]] == [solo[0], solo[2]]
    assert streamed[victim.request_id] == solo[1][: len(streamed[victim.request_id])]
    check_all_back(engine)


def test_preempted_while_its_token_is_computed(make_engine, prompts):
    """A cache too small for every request: the newest are preempted (some with a token in flight) and
    recomputed; each still gets the tokens it gets without overlap."""
    params = SamplingParams(max_new_tokens=24)
    small = {"max_batch_total_tokens": 112, "block_size": 8}
    expected = finals(make_engine(overlap_steps=False, **small).generate(prompts, params))
    engine = make_engine(overlap_steps=True, **small)
    counts = counting_launches(engine)
    pending_at_preemption = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda r: pending_at_preemption.append(r.num_pending) or preempt(r)
    assert finals(engine.generate(prompts, params)) == expected
    assert any(pending_at_preemption) and counts["chained"] > 0, pending_at_preemption
    check_all_back(engine)


def test_blocks_enter_the_prefix_cache_with_their_tokens_not_placeholders(make_engine, prompts):
    """A request's decoded blocks are registered once their tokens are read: a second request whose prompt is the
    first one's text takes them from the cache."""
    params = SamplingParams(max_new_tokens=40)
    engine = make_engine(overlap_steps=True, block_size=8)
    first = engine.generate([prompts[0]], params)[0]
    follow_up = prompts[0] + first.token_ids[:30]
    hits_before = engine.scheduler.prefix_hits
    again = engine.generate([follow_up], SamplingParams(max_new_tokens=8))[0]
    assert engine.scheduler.prefix_hits - hits_before == (len(follow_up) - 1) // 8 * 8
    cold = make_engine(overlap_steps=False, prefix_caching=False).generate([follow_up], SamplingParams(max_new_tokens=8))
    assert again.token_ids == cold[0].token_ids
    check_all_back(engine)


def test_a_row_failing_in_a_launched_step_leaves_nothing_it_wrote_in_the_prefix_cache(make_engine, prompts):
    """The failed step's key and value filled a block (registered as the step was planned): the block leaves the
    cache with the request, so a later request with the same tokens computes it again."""
    engine = make_engine(overlap_steps=True, block_size=4)
    prompt = (prompts[0] + prompts[2])[:7]  # positions 0-6: the first decode step writes 7, the end of block 1
    assert len(prompt) == 7
    victim = engine.add_request(prompt, SamplingParams(max_new_tokens=10))
    land = engine.runner.land

    def failing(launched):  # the first launched step's row fails
        engine.runner.land = land
        return [type(result)(error="the row failed") for result in land(launched)]

    engine.runner.land = failing
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert outputs[-1].error == "the row failed" and len(victim.output_ids) == 1
    hits_before = engine.scheduler.prefix_hits
    again = engine.generate([prompt + victim.output_ids + [5, 6, 7]], SamplingParams(max_new_tokens=2))[0]
    assert again.error is None
    assert engine.scheduler.prefix_hits - hits_before == 4  # block 0 only: block 1 held the failed step's write
    check_all_back(engine)
