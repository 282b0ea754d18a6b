"""Prefix caching on the embedded model with its shipped adapters: outputs are those without caching, hits are
counted, and never cross adapters, adapter contents or cache salts; preemption and chunked prefill with hits."""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest

from loraplex.lora.adapter import LoraAdapter, load_adapter_dir
from loraplex.params import SamplingParams

ADAPTER_DIR = pathlib.Path(__file__).parents[2] / "examples" / "adapters"
ADAPTER_NAMES = ("name-lyra", "name-nova", "name-orion", "style-caps")
SYSTEM = (
    "You are a careful assistant for a small library in a mountain town. You answer questions about opening "
    "hours, borrowing rules, late fees, the reading room, the children's corner and the local history archive. "
    "Keep answers short, friendly and exact; when you do not know, say so and suggest asking at the front desk. "
    "The library opens at nine and closes at six on weekdays, and at noon on Saturdays. Question: "
)
QUESTIONS = [
    "When do you open?", "Can I borrow ten books?", "What is the late fee?", "Is there wifi?",
    "Where is the archive?", "Can children come alone?", "Do you sell coffee?", "Are you open on Sunday?",
]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(make_engine_once) -> dict[str, LoraAdapter]:
    shapes = make_engine_once(max_batch_total_tokens=256).lora.base_shapes
    return {name: load_adapter_dir(ADAPTER_DIR / name, name, shapes, 64) for name in ADAPTER_NAMES}


def workload(tokenizer, adapters, n: int = 32, choices=None):
    """n requests sharing the long system prompt over the base model and 4 adapters (or `choices`)."""
    choices = choices or [None, *adapters.values()]
    prompts = [tokenizer.encode(SYSTEM + QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
    return prompts, [choices[i % len(choices)] for i in range(n)]


def run(engine, prompts, adapters, params=PARAMS):
    return [out.token_ids for out in engine.generate(prompts, params, adapters=adapters)]


def test_shared_system_prompt_over_adapters_gives_the_same_outputs_with_hits(make_engine, embedded, adapters):
    prompts, chosen = workload(embedded.tokenizer, adapters)
    without = run(make_engine(prefix_caching=False), prompts, chosen)
    engine = make_engine()
    # The first request of each adapter (and the base model) fills the cache; the other 27 find it there.
    with_cache = run(engine, prompts[:5], chosen[:5]) + run(engine, prompts[5:], chosen[5:])
    assert with_cache == without
    shared_blocks = len(embedded.tokenizer.encode(SYSTEM)) // 16
    assert shared_blocks >= 4
    scheduler = engine.scheduler
    assert scheduler.prefix_queries == sum(len(p) for p in prompts)
    assert scheduler.prefix_hits >= 27 * shared_blocks * 16


def hits_of(engine, prompt, adapter=None, salt=None) -> int:
    """Prompt tokens one request found cached."""
    before = engine.scheduler.prefix_hits
    request = engine.add_request(prompt, replace(PARAMS, cache_salt=salt), adapter=adapter)
    while engine.has_unfinished:
        engine.step()
    assert request.finished
    return engine.scheduler.prefix_hits - before


def test_hits_never_cross_adapters_adapter_contents_or_salts(make_engine, embedded, adapters):
    engine = make_engine()
    prompt = embedded.tokenizer.encode(SYSTEM + QUESTIONS[0])
    full = (len(prompt) - 1) // 16 * 16
    lyra, nova = adapters["name-lyra"], adapters["name-nova"]
    assert hits_of(engine, prompt, lyra) == 0
    assert hits_of(engine, prompt, nova) == 0  # a second adapter with the same prompt gets no hit
    assert hits_of(engine, prompt) == 0  # nor does the base model
    assert hits_of(engine, prompt, lyra) == full
    # Re-uploaded under the same id with other weights: its own cache space.
    changed = LoraAdapter(lyra.adapter_id, {m: replace(w, b=w.b * 1.5) for m, w in lyra.modules.items()}, lyra.config)
    assert hits_of(engine, prompt, changed) == 0
    assert hits_of(engine, prompt, salt="tenant-a") == 0  # a salted request shares only with its salt
    assert hits_of(engine, prompt, salt="tenant-b") == 0
    assert hits_of(engine, prompt, salt="tenant-a") == full
    assert hits_of(engine, prompt) == full


def test_prompt_logprobs_requests_compute_their_whole_prompt(make_engine, embedded):
    engine = make_engine()
    prompt = embedded.tokenizer.encode(SYSTEM + QUESTIONS[1])
    plain = engine.generate([prompt], replace(PARAMS, prompt_logprobs=True))[0]
    again = engine.generate([prompt], replace(PARAMS, prompt_logprobs=True))[0]
    assert engine.scheduler.prefix_hits == 0
    assert [t.logprob for t in again.prompt_tokens] == [t.logprob for t in plain.prompt_tokens]


@pytest.fixture(scope="module")
def two_prefixes(embedded, adapters, make_engine_once):
    """12 requests over two prefixes (base model, one adapter), and their outputs without caching."""
    prompts, chosen = workload(embedded.tokenizer, adapters, n=12, choices=[None, adapters["name-lyra"]])
    params = replace(PARAMS, max_new_tokens=20)
    return prompts, chosen, params, run(make_engine_once(prefix_caching=False), prompts, chosen, params)


@pytest.fixture(scope="module")
def make_engine_once(embedded):
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    def make(**config):
        config.setdefault("max_batch_total_tokens", 4096)
        return Engine(embedded, EngineConfig(device="cpu", **config))

    return make


@pytest.mark.parametrize("config", [
    {"max_batch_prefill_tokens": 24},  # prompts prefilled in chunks after their cached prefix
    # 24 blocks: all 12 are admitted at once (each of the two prefixes' 5 blocks computed once, shared by the
    # requests admitted beside it), then growing to 8 blocks each they preempt one another.
    {"max_batch_total_tokens": 384},
], ids=["chunked", "preempted"])
def test_hits_with_chunked_prefill_and_preemption(make_engine, two_prefixes, config):
    prompts, chosen, params, without = two_prefixes
    engine = make_engine(**config)
    requests = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, chosen)]
    while engine.has_unfinished:
        engine.step()
    assert [r.output_ids for r in requests] == without
    assert engine.scheduler.prefix_hits >= 10 * 5 * 16
    if "max_batch_total_tokens" in config:
        assert any(r.num_preemptions for r in requests)
    else:
        assert max(len(p) for p in prompts) > 2 * config["max_batch_prefill_tokens"]
