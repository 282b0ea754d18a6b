"""The encoder-decoder path of the engine (T5): batching, arrivals, preemption, forced tokens, refusals and
the cross-attention states' KV blocks. transformers' greedy tokens, one request at a time, are the truth."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.requests.request import RequestRefused
from loraplex.engine.scheduling.kv_cache import blocks_for
from loraplex.params import SamplingParams
from tests.helpers import engine_for, hf_seq2seq_greedy, load_ours, tiny_t5

NEW = 10
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    hf = tiny_t5(gated=True, seed=3)
    ours, config = load_ours(hf, tmp_path_factory.mktemp("t5"))
    return hf, ours, config


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    lengths = [3, 45, 17, 1, 60, 8, 30, 22]  # from one token to past the position buckets' max distance
    return [[rng.randrange(2, 300) for _ in range(n - 1)] + [1] for n in lengths]


@pytest.fixture(scope="module")
def expected(t5, prompts):
    hf, _, _ = t5
    return [hf_seq2seq_greedy(hf, p, NEW) for p in prompts]


def test_the_inputs_matter(expected):
    """The tiny model's outputs depend on its input: otherwise the other tests would prove little."""
    assert len({tuple(e) for e in expected}) == len(expected)
    assert all(len(set(e)) > 2 for e in expected)


def test_inputs_of_different_lengths_in_one_batch(t5, prompts, expected):
    _, ours, config = t5
    outs = engine_for(ours, config).generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == expected
    assert [o.num_prompt_tokens for o in outs] == [len(p) for p in prompts]


def test_requests_arriving_while_others_decode(t5, prompts, expected):
    _, ours, config = t5
    engine = engine_for(ours, config)
    finals = {}
    pending = list(enumerate(prompts))
    ids = {}
    while pending or engine.has_unfinished:
        if pending:  # one new request every step, joining the others mid-decode
            i, prompt = pending.pop(0)
            ids[engine.add_request(prompt, PARAMS).request_id] = i
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out.token_ids
    assert [finals[i] for i in range(len(prompts))] == expected


def test_preemption_recomputes_the_encoder_without_changing_outputs(t5, prompts, expected):
    _, ours, config = t5
    # Room for a few requests only: the cache fills while they decode, so some are preempted (their
    # decoder KV and cross-attention states freed) and later recomputed from their encoder input.
    engine = engine_for(ours, config, max_batch_total_tokens=248, block_size=4)
    requests = [engine.add_request(p, PARAMS) for p in prompts]
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    assert sum(r.num_preemptions for r in requests) > 0, "the test meant to force a preemption"
    assert [finals[r.request_id] for r in requests] == expected
    assert engine.scheduler.allocator.num_used == 0


def test_cross_attention_states_take_kv_blocks_and_give_them_back(t5, prompts):
    _, ours, config = t5
    engine = engine_for(ours, config, block_size=16)
    request = engine.add_request(prompts[4], SamplingParams(max_new_tokens=3, ignore_eos=True))  # 60 tokens
    engine.step()
    assert len(request.cross_block_ids) == blocks_for(60, 16)
    assert engine.scheduler.allocator.num_used == len(request.cross_block_ids) + len(request.block_ids)
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.allocator.num_used == 0 and not request.cross_block_ids


def test_admission_counts_the_states(t5, prompts):
    """Two 60-token inputs need 4 blocks each for their states alone: a 10-block cache runs one at a time."""
    _, ours, config = t5
    engine = engine_for(ours, config, max_batch_total_tokens=160, block_size=16)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first, second = engine.add_request(prompts[4], params), engine.add_request(prompts[4], params)
    engine.step()
    assert first.cross_block_ids and not second.cross_block_ids
    while engine.has_unfinished:
        engine.step()


def test_forced_tokens_as_transformers(tmp_path, prompts):
    hf = tiny_t5(gated=False, seed=5)
    hf.generation_config.forced_bos_token_id = 7
    hf.generation_config.forced_eos_token_id = 9
    ours, config = load_ours(hf, tmp_path)
    from loraplex.engine.loading import with_generation_config

    config = with_generation_config(config, hf.generation_config.to_dict())
    outs = engine_for(ours, config).generate(prompts[:3], PARAMS)
    want = [hf_seq2seq_greedy(hf, p, NEW) for p in prompts[:3]]
    assert [o.token_ids for o in outs] == want
    assert all(o.token_ids[0] == 7 and o.token_ids[-1] == 9 for o in outs)


def test_too_long_inputs_are_refused_not_truncated(t5):
    _, ours, config = t5
    engine = engine_for(ours, config, max_input_length=32)
    with pytest.raises(RequestRefused, match="must be <= 32"):
        engine.add_request(list(range(2, 40)), PARAMS)
    small = engine_for(ours, config, max_batch_total_tokens=64, block_size=16)
    with pytest.raises(RequestRefused, match="KV cache"):
        small.add_request(list(range(2, 60)), SamplingParams(max_new_tokens=20))


def test_prompt_logprobs_are_not_invented_for_an_encoder_input(t5, prompts):
    _, ours, config = t5
    (out,) = engine_for(ours, config).generate([prompts[1]], SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    assert out.prompt_tokens is None and out.num_prompt_tokens == len(prompts[1])
