"""Continuous batching on the embedded model: batch invariance, preemption, chunked prefill, aborts."""

import random

import pytest

from loraplex.params import SamplingParams

TEXTS = [
    "The quick brown fox",
    "In 1492, Columbus sailed",
    "def add(a, b):",
    "Photosynthesis is the process by which",
    "My favourite recipe for pancakes needs",
    "The three laws of robotics are",
    "Dear diary, today I",
    "SELECT name FROM users WHERE",
    "The mitochondria is",
    "Once there was a dragon who loved",
    "To be or not to be,",
    "The stock market today",
    "import numpy as np\nx =",
    "A haiku about winter:",
    "The best way to learn a language is",
    "Rain fell on the quiet town as",
]


def workload(tokenizer, n: int = 16, rng_seed: int = 0, **params):
    """n prompts of different lengths (some repeated words to vary length) and different output lengths."""
    rng = random.Random(rng_seed)
    prompts, plist = [], []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)] + " and then" * rng.randint(0, 12)
        prompts.append(tokenizer.encode(text))
        plist.append(SamplingParams(max_new_tokens=rng.randint(4, 24), ignore_eos=True, **params))
    return prompts, plist


def solo(make_engine, prompts, plist, **config):
    engine = make_engine(**config)
    return [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, plist)]


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_batch_invariance(make_engine, embedded, sampling):
    prompts, plist = workload(embedded.tokenizer, **sampling)
    together = [r.token_ids for r in make_engine().generate(prompts, plist)]
    alone = solo(make_engine, prompts, plist)
    assert [len(t) for t in together] == [sp.max_new_tokens for sp in plist]
    assert together == alone


def test_preempted_requests_resume_exactly(make_engine, embedded):
    # 6 requests of 20 prompt + 28 new tokens (2 blocks each at admission, 3 at the end) over an 8-block
    # cache: four are admitted, and they outgrow the cache while decoding.
    tok = embedded.tokenizer
    prompts = [tok.encode(" ".join(TEXTS[i : i + 4]))[:20] for i in range(6)]
    plist = [SamplingParams(max_new_tokens=28, ignore_eos=True)] * 6
    reference = solo(make_engine, prompts, plist)
    engine = make_engine(max_batch_total_tokens=128)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    assert sum(r.num_preemptions for r in requests) > 0, "the cache was meant to be too small"
    assert [finals[r.request_id] for r in requests] == reference
    assert engine.scheduler.allocator.num_used == 0


def test_chunked_prefill_matches_one_shot_prefill(make_engine, embedded):
    prompts, plist = workload(embedded.tokenizer, n=6, rng_seed=5)
    reference = solo(make_engine, prompts, plist)
    chunked = make_engine(max_batch_prefill_tokens=7)  # every prompt spans several steps
    assert [r.token_ids for r in chunked.generate(prompts, plist)] == reference


def test_abort_frees_blocks_at_once(make_engine, embedded):
    engine = make_engine()
    prompts, plist = workload(embedded.tokenizer, n=4, rng_seed=7)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, plist)]
    engine.step()
    assert engine.scheduler.allocator.num_used > 0
    for rid in ids:
        assert engine.abort_request(rid)
    assert engine.scheduler.allocator.num_used == 0 and not engine.has_unfinished
    assert not engine.abort_request(ids[0])
