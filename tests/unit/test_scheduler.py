"""Scheduler and block allocator: budgets, admission, preemption, block accounting. No torch."""

import subprocess
import sys

import pytest

from loraplex.engine.scheduling.kv_cache import BlockAllocator, blocks_for
from loraplex.engine.requests.request import Request, RequestStatus
from loraplex.params import FinishReason
from loraplex.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from loraplex.params import SamplingParams


def make_request(rid: str, prompt_len: int, max_new: int = 8, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new), 0, arrival)


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule once and play the engine's part: advance computed tokens, append one token when sampled."""
    out = scheduler.schedule()
    for item in out.scheduled:
        completes = item.completes_sequence
        item.request.num_computed_tokens += item.num_new_tokens
        if completes:
            item.request.output_ids.append(7)
    return {item.request.request_id: item.num_new_tokens for item in out.scheduled}


def test_scheduler_modules_do_not_import_torch():
    code = "import sys, loraplex.engine.scheduling.scheduler, loraplex.engine.scheduling.kv_cache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocator_allocates_frees_and_refuses():
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    ids = alloc.allocate(3)
    assert len(set(ids)) == 3 and alloc.num_free == 1 and alloc.usage == 0.75
    with pytest.raises(MemoryError):
        alloc.allocate(2)
    alloc.free(ids)
    assert alloc.num_free == 4 and alloc.num_used == 0
    with pytest.raises(AssertionError):
        alloc.free([ids[0]])
    assert blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2 and blocks_for(0, 16) == 0


def test_prefill_budget_limits_admission_and_chunks_long_prompts():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batch_prefill_tokens=10))
    s.add(make_request("a", 6))
    s.add(make_request("b", 6))
    s.add(make_request("c", 25))
    assert run_step(s) == {"a": 6, "b": 4}  # b's prompt is chunked to the remaining budget
    assert run_step(s) == {"a": 1, "b": 2, "c": 8}  # decode rows do not draw on the prefill budget
    assert run_step(s) == {"a": 1, "b": 1, "c": 10}
    assert run_step(s) == {"a": 1, "b": 1, "c": 7}
    assert s.get("c").num_computed_tokens == 25 and len(s.get("c").output_ids) == 1


def test_max_num_seqs_caps_running_requests():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_num_seqs=2))
    for rid in "abc":
        s.add(make_request(rid, 3))
    assert set(run_step(s)) == {"a", "b"}
    s.finish(s.get("a"), FinishReason.LENGTH)
    assert set(run_step(s)) == {"b", "c"}


def test_admission_waits_for_free_blocks():
    s = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    s.add(make_request("a", 12, max_new=4))  # 3 blocks
    s.add(make_request("b", 8, max_new=4))  # 2 blocks: does not fit beside a
    assert run_step(s) == {"a": 12}
    assert s.waiting[0].request_id == "b"
    s.finish(s.get("a"), FinishReason.EOS_TOKEN)
    assert s.allocator.num_free == 4
    assert run_step(s) == {"b": 8}


def test_preemption_takes_the_newest_running_request_and_recomputes_it():
    s = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    s.add(make_request("old", 4, arrival=0))
    s.add(make_request("new", 4, arrival=1))
    run_step(s)  # both prefilled: 1 block each, one sampled token each
    run_step(s)  # token 5 needs a second block each: 4 blocks used
    assert s.allocator.num_free == 0
    for _ in range(3):
        run_step(s)  # tokens 6..8 fit the second blocks
    # Token 9 of each needs a third block; none free: "new" is preempted for "old".
    out = s.schedule()
    assert [p.request_id for p in out.preempted] == ["new"]
    assert [i.request.request_id for i in out.scheduled] == ["old"]
    new = s.get("new")
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and new.block_ids == []
    assert new.num_preemptions == 1 and len(new.output_ids) == 5  # generated tokens are kept
    assert s.waiting[0] is new  # it goes back to the front


def test_a_request_that_could_never_fit_is_refused_at_add():
    s = Scheduler(SchedulerConfig(num_blocks=2, block_size=4))
    with pytest.raises(AssertionError, match="never fit"):
        s.add(make_request("a", 8, max_new=1))
    s.add(make_request("b", 7, max_new=1))


def test_blocks_return_on_finish_and_abort():
    s = Scheduler(SchedulerConfig(num_blocks=10, block_size=4))
    s.add(make_request("a", 9))
    s.add(make_request("b", 5))
    s.add(make_request("c", 5))
    run_step(s)
    assert s.allocator.num_used == 3 + 2 + 2
    s.finish(s.get("a"), FinishReason.LENGTH)
    assert s.abort("b").finish_reason is FinishReason.ABORTED
    assert s.abort("missing") is None
    assert s.allocator.num_used == 2
    s.abort("c")
    assert s.allocator.num_used == 0 and not s.has_unfinished


def test_abort_of_a_waiting_request_removes_it():
    s = Scheduler(SchedulerConfig(num_blocks=1, block_size=4))
    s.add(make_request("a", 3, max_new=1))
    s.add(make_request("b", 3, max_new=1))
    run_step(s)
    assert s.abort("b") is not None and not s.waiting


def test_no_admission_in_a_step_that_preempted():
    s = Scheduler(SchedulerConfig(num_blocks=3, block_size=4))
    s.add(make_request("a", 4, arrival=0))
    s.add(make_request("b", 4, arrival=1))
    run_step(s)  # 2 blocks used, 1 free
    s.add(make_request("c", 4, arrival=2))
    out = s.schedule()  # a takes the last block; b (newest running) must give its own back
    assert [p.request_id for p in out.preempted] == ["b"]
    assert [i.request.request_id for i in out.scheduled] == ["a"]
    assert s.allocator.num_free == 1  # c would fit, but is not admitted in a step that preempted
    assert [r.request_id for r in s.waiting] == ["b", "c"]

