"""Prefix caching without a model: the allocator's shared and evictable blocks, the hash chain's keys, and the
scheduler's admission from cached blocks. No torch."""

import pytest

from loraplex.engine.scheduling.kv_cache import BlockAllocator
from loraplex.engine.scheduling.prefix_cache import block_hashes, root_key
from loraplex.engine.requests.request import Request
from loraplex.params import FinishReason
from loraplex.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from loraplex.params import SamplingParams
from tests.unit.test_scheduler import run_step

BS = 4


def cached_request(rid: str, prompt: list[int], key: bytes = b"", max_new: int = 4, **params) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new, **params), 0, 0.0)
    request.cache_key = root_key(key or None, None, None)
    return request


def caching_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, prefix_caching=True, **config))


def step_and_finish(s: Scheduler) -> None:
    run_step(s)
    for r in [r for r in s.running if len(r.output_ids) >= r.params.max_new_tokens]:
        s.finish(r, FinishReason.LENGTH)


def finish_all(s: Scheduler) -> None:
    while s.running or s.waiting:
        step_and_finish(s)


def test_allocator_shares_registered_blocks_and_evicts_least_recently_released_first():
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    a, b = alloc.allocate(2)
    assert alloc.take_fresh() == [a, b]
    alloc.register(a, b"A")
    alloc.register(b, b"B")
    assert alloc.cached_blocks([b"A", b"B", b"C"]) == [a, b]
    assert alloc.cached_blocks([b"B"]) == [b] and alloc.cached_blocks([b"X", b"A"]) == []
    alloc.take_cached([a])  # a second request holds a
    alloc.free([b, a])  # the first lets go, last block first
    assert alloc.num_used == 1 and alloc.num_free == 3  # b is cached, nobody holds it: allocatable
    alloc.free([a])
    assert alloc.num_evictable([a, b]) == 2 and alloc.num_cached == 2
    # Plain free blocks go first; then the cached block released first (b) is evicted before a.
    first = alloc.allocate(2)
    assert a not in first and b not in first and alloc.num_cached == 2
    assert alloc.allocate(1) == [b] and alloc.cached_blocks([b"A", b"B"]) == [a]
    assert alloc.take_fresh() == first + [b]  # an evicted block is zeroed like any reused one
    with pytest.raises(MemoryError):
        alloc.allocate(2)


def test_allocator_keeps_the_first_block_registered_for_content():
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    a, b = alloc.allocate(2)
    alloc.register(a, b"same")
    alloc.register(b, b"same")  # two requests computed the same prefix at once: the first one stays
    assert alloc.cached_blocks([b"same"]) == [a]
    alloc.free([b])
    assert alloc.num_evictable([b]) == 0 and alloc.num_free == 3  # b was never cached: plainly free


def test_hash_chain_depends_on_prefix_adapter_salt_encoder_input_and_images():
    prompt = list(range(1, 13))
    base = block_hashes(cached_request("a", prompt), 3, BS)
    assert len(set(base)) == 3
    assert block_hashes(cached_request("b", prompt), 3, BS) == base
    changed = prompt[:5] + [99] + prompt[6:]  # a token in block 1 changes blocks 1 and 2, not 0
    other = block_hashes(cached_request("c", changed), 3, BS)
    assert other[0] == base[0] and other[1] != base[1] and other[2] != base[2]
    assert block_hashes(cached_request("d", prompt, key=b"adapter"), 3, BS)[0] != base[0]
    salted = Request("e", prompt, SamplingParams(), 0, 0.0)
    salted.cache_key = root_key(None, "tenant-1", None)
    assert block_hashes(salted, 1, BS)[0] != base[0]
    assert root_key(None, None, [1, 2]) != root_key(None, None, [1, 3]) != root_key(None, None, None)

    class Images:  # placeholders at positions 5 and 6 (block 1)
        positions = [5, 6]

    for digest in (b"cat", b"dog"):
        seen = cached_request("f", prompt)
        seen.images, seen.image_digest = Images(), digest
        hashes = block_hashes(seen, 3, BS)
        assert hashes[0] == base[0] and hashes[1] != base[1]  # blocks before the image are text alone
        if digest == b"cat":
            cat = hashes
    assert hashes[1] != cat[1] and hashes[2] != cat[2]


def test_admission_takes_cached_blocks_but_always_computes_the_last_token():
    s = caching_scheduler()
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    s.add(cached_request("a", prompt))
    finish_all(s)
    s.add(cached_request("b", prompt))
    assert run_step(s) == {"b": 1}  # blocks 0-2 cached: only token 12 runs
    assert (s.prefix_queries, s.prefix_hits) == (26, 12)
    finish_all(s)
    exact = list(range(1, 13))  # 12 tokens = 3 full blocks: the last block is recomputed for its last token
    s.add(cached_request("c", exact))
    assert run_step(s) == {"c": 4} and s.prefix_hits == 12 + 8


def test_no_hit_across_keys_or_for_prompt_logprobs():
    s = caching_scheduler()
    prompt = list(range(1, 14))
    s.add(cached_request("a", prompt, key=b"adapter-1"))
    finish_all(s)
    s.add(cached_request("b", prompt, key=b"adapter-2"))
    s.add(cached_request("c", prompt, key=b"adapter-1", prompt_logprobs=True))
    assert run_step(s) == {"b": 13, "c": 13} and s.prefix_hits == 0
    uncached = Request("d", prompt, SamplingParams(max_new_tokens=4), 0, 0.0)  # cache_key None: caching off for it
    s.add(uncached)
    assert run_step(s)["d"] == 13


def test_running_requests_share_blocks_and_free_them_once():
    s = caching_scheduler(num_blocks=16)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    s.add(cached_request("a", prompt, max_new=8))
    s.add(cached_request("b", prompt, max_new=8))  # admitted in a's step: it shares the blocks a's step fills
    assert run_step(s) == {"a": 17, "b": 1}
    a, b = s.get("a"), s.get("b")
    assert a.block_ids[:4] == b.block_ids[:4] and a.block_ids[4] != b.block_ids[4]
    assert s.allocator.num_used == 6 and s.prefix_hits == 16
    s.finish(a, FinishReason.LENGTH)
    assert s.allocator.num_used == 5  # the shared blocks stay while b holds them
    s.finish(b, FinishReason.LENGTH)
    assert s.allocator.num_used == 0 and s.allocator.num_free == 16


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    s = caching_scheduler(num_blocks=8)
    s.add(cached_request("a", list(range(1, 10)), max_new=12))  # 9 tokens + 12 new: 6 blocks at the end
    s.add(cached_request("b", list(range(50, 59)), max_new=12))
    for _ in range(30):
        step_and_finish(s)
        if s.get("b").num_preemptions:
            break
    victim = s.get("b")
    assert victim.num_preemptions == 1 and victim.num_computed_tokens == 0, "the cache was meant to run out"
    hits_before = s.prefix_hits
    while victim.num_computed_tokens == 0:
        step_and_finish(s)
    assert s.prefix_hits > hits_before  # its recomputation started from what it had computed
    assert victim.num_computed_tokens < victim.num_tokens


def test_admission_counts_evictable_hits_against_free_blocks():
    s = caching_scheduler(num_blocks=6, watermark_blocks=0)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token; 4 new tokens -> 5 blocks in all
    s.add(cached_request("a", prompt))
    finish_all(s)
    assert s.allocator.num_free == 6 and s.allocator.num_cached == 4
    s.add(cached_request("b", prompt))
    run_step(s)
    assert s.get("b").num_computed_tokens == 13 and s.allocator.num_used == 4


def test_blocks_of_a_step_that_failed_are_withdrawn_from_the_cache():
    s = caching_scheduler()
    prompt = list(range(1, 14))
    s.add(cached_request("a", prompt))
    s.schedule()  # planned (its 3 full blocks registered), but the step fails: nothing was computed
    s.finish(s.get("a"), FinishReason.ABORTED)
    assert s.allocator.num_cached == 0
    s.add(cached_request("b", prompt))
    assert run_step(s) == {"b": 13} and s.prefix_hits == 0
