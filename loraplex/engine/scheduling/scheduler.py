"""Decides, each step, which requests run and how many tokens each computes. Pure Python.

Policy:
- Running requests go first, oldest first; each gets its next token (or the next chunk of a prompt
  that did not fit one step). When the KV cache has no block for one, the most recently admitted
  running request is preempted (its blocks freed; it is recomputed from its tokens later).
- Waiting requests are admitted first-come first-served while the step's prefill token budget, the
  running-request cap and the free KV blocks (less a small watermark) allow. A prompt longer than the
  budget is prefilled in chunks over several steps.
- No admission in a step that had to preempt: the cache is full, admitting would only thrash.
- Where decode steps replay CUDA graphs, waiting requests join running ones only now and then (`joins`,
  engine/scheduling/joins.py: LoRAX's max-waiting-tokens and waiting-served-ratio), since a step that admits runs eagerly.
- Speculative decoding: once every running request has its token and waiting ones are admitted, a decoding
  request with drafts (engine/sampling/speculative.py) is scheduled for them too, as far as its blocks and the free
  blocks above the watermark allow. Drafts are cut first: never a reason to preempt or to turn a request away.
- A request with cross-attention states (an encoder-decoder's encoder output, a vision model's image
  states) also holds KV blocks for them, taken at admission and freed with the rest; its states count
  against the prefill budget of the step that admits it (the encoder or image encoder that makes them runs
  then, whole: it cannot be chunked). States come from a pool of their own when the model's cross-attention layers cache nothing
  else (Mllama: `num_state_blocks`), else from the token pool (T5, BART: a decoder layer caches both).
- Prefix caching (`prefix_caching`): a request's full blocks are registered under their content hash
  (`prefix_cache`) once computed; a request being admitted takes the longest run of its full blocks the
  cache holds (never its last token: that one must run to give logits) and computes only the rest. A
  request asking for prompt logprobs looks nothing up (cached tokens are not scored again). Cached
  blocks nobody holds are evicted least recently used first, when no free block is left.
- A request for an adapter is admitted only when its adapter holds, or can take, a device slot (see
  `AdapterResidency`: pinned while used, LRU reuse, fair rotation). A request that cannot have a slot yet
  is passed over; requests behind it still start. So at most `num_adapter_slots` distinct adapters
  run in one step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from loraplex.engine.scheduling.joins import WaitingJoins
from loraplex.engine.scheduling.kv_cache import BlockAllocator, blocks_for
from loraplex.engine.scheduling.prefix_cache import block_hashes
from loraplex.engine.requests.request import Request, RequestStatus
from loraplex.lora.device.residency import AdapterResidency
from loraplex.params import FinishReason


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_batch_prefill_tokens: int = 4096
    max_num_seqs: int = 256
    watermark_blocks: int = 0  # kept free at admission so running requests can grow a little
    num_adapter_slots: int = 1
    adapter_cycle_time_s: float = 2.0
    num_state_blocks: int = 0  # > 0: cross-attention states get a block pool of their own
    prefix_caching: bool = False
    # LongRoPE: a running request whose decode step would take it from this many computed tokens past them is
    # recomputed from its tokens instead (preempted), so that every key is rotated with the long factors.
    recompute_after: int | None = None


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed for it this step, from request.num_computed_tokens on

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token is computed, so the step samples a next token."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens

    @property
    def num_drafts(self) -> int:
        """Draft tokens it verifies this step: those scheduled past its known tokens."""
        return max(0, self.request.num_computed_tokens + self.num_new_tokens - self.request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (slot, adapter id): adapters that take a slot this step; the engine installs them before running.
    installs: list[tuple[int, str]] = field(default_factory=list)
    # KV blocks newly allocated this step, to be zeroed before the step runs (states' blocks apart when
    # they have a pool of their own).
    fresh_blocks: list[int] = field(default_factory=list)
    fresh_state_blocks: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock=None) -> None:
        self.config = config
        self.slots = AdapterResidency(config.num_adapter_slots, config.adapter_cycle_time_s, clock or time.monotonic)
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.state_allocator = (
            BlockAllocator(config.num_state_blocks, config.block_size) if config.num_state_blocks else self.allocator
        )
        # When waiting requests join while others run (joins.py); by default at every step.
        self.joins = WaitingJoins()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self._by_id: dict[str, Request] = {}
        # Prefix caching: prompt tokens of admitted requests that looked for cached blocks, and those found.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0  # ever, for /metrics: a cache too small for the admitted work shows here

    # ---- membership -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        assert request.request_id not in self._by_id, f"duplicate request id {request.request_id}"
        # The engine refuses longer requests, so a request running alone always fits.
        longest = blocks_for(len(request.prompt_ids) + request.params.max_new_tokens, self.config.block_size)
        assert self.fits_alone(longest, self._cross_blocks(request)), (
            "request can never fit the KV cache; the engine must refuse it"
        )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._by_id[request.request_id] = request

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request for good (finished or aborted) and free its blocks."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_slot(request)
        else:
            self.waiting.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._by_id[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self._by_id.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORTED)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_batch_prefill_tokens
        index, prefilling = 0, False
        while index < len(self.running):
            request = self.running[index]
            n = request.num_uncomputed_tokens
            if n == 0:  # its next token ends it, and a launched step is computing it (engine/worker/overlap.py)
                index += 1
                continue
            if n > 1:  # an unfinished (chunked) prefill draws on the prefill budget
                n = min(n, budget)
                if n == 0:
                    index += 1
                    continue
            if self._outgrows_context(request, n):
                out.preempted.append(self._preempt(request))
                continue
            needed = self._blocks_needed(request, n)
            assert request.cross_block_ids or not request.num_states, "a running request holds its states"
            if needed:  # most decode steps fit in the request's last block
                while not self.allocator.can_allocate(needed) and self.running[-1] is not request:
                    out.preempted.append(self._preempt(self.running[-1]))
                if not self.allocator.can_allocate(needed):
                    out.preempted.append(self._preempt(request))  # it is the last one left to give
                    break
                self._allocate(request, needed)
            if n > 1:
                budget -= n
                prefilling = True
            self._cache_blocks(request, n)
            out.scheduled.append(ScheduledRequest(request, n))
            index += 1

        running = len(out.scheduled)
        if not out.preempted and self.waiting and self.joins.due(len(self.waiting), running, prefilling):
            self._admit(out, budget)
        self.joins.stepped(joined=len(out.scheduled) > running)
        self._add_drafts(out)
        out.fresh_blocks = self.allocator.take_fresh()
        if self.state_allocator is not self.allocator:
            out.fresh_state_blocks = self.state_allocator.take_fresh()
        return out

    def _outgrows_context(self, request: Request, n: int) -> bool:
        """Whether this decode step takes the request past `recompute_after` (a prefill, its recompute included,
        never is: its rows see the whole sequence's length)."""
        limit = self.config.recompute_after
        return limit is not None and request.num_uncomputed_tokens == n == 1 and request.num_computed_tokens == limit

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Start waiting requests, first come first served, while budget, seats and KV blocks allow."""
        self.slots.begin_step([r.adapter_key for r in self.waiting if r.adapter_key is not None])
        passed_over: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            assert not request.num_pending, "a preempted request's tokens are all read before it is admitted again"
            hit = self._cached_prefix(request)  # None: it looks nothing up
            cached = hit or []
            computed = len(cached) * self.config.block_size
            n = min(request.num_tokens - computed, budget)
            needed = blocks_for(computed + n, self.config.block_size) - len(cached)
            taken = self.allocator.num_evictable(cached)  # cached blocks nobody holds count as free until taken
            if not self._can_take(needed + taken + self.config.watermark_blocks, self._missing_state_blocks(request)):
                break
            self.waiting.popleft()
            if request.adapter_key is not None and not self._take_slot(request, out):
                passed_over.append(request)
                continue
            if hit is not None:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += computed
                self.allocator.take_cached(hit)
                request.block_ids, request.num_cached_blocks, request.num_computed_tokens = hit, len(hit), computed
            self._allocate(request, needed)
            self._cache_blocks(request, n)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            if n > 1:
                budget -= n
            budget -= request.num_states  # its encoder (or image encoder) runs this step too
        self.waiting.extendleft(reversed(passed_over))  # they keep their place in the queue

    def _cached_prefix(self, request: Request) -> list[int] | None:
        """The cached blocks a waiting request can start from; None when it looks nothing up."""
        pooling = request.params.pooling  # pooled over all rows, or the first: every row must run
        if (not self.config.prefix_caching or request.cache_key is None or request.params.prompt_logprobs
                or (pooling is not None and pooling.method != "last")):
            return None
        assert request.num_computed_tokens == 0 and not request.block_ids, "a waiting request holds no blocks"
        most = (request.num_tokens - 1) // self.config.block_size  # its last token must run
        return self.allocator.cached_blocks(block_hashes(request, most, self.config.block_size))

    def _cache_blocks(self, request: Request, num_new_tokens: int) -> None:
        """Register the blocks the request's step fills (as the step is planned, not after it ran: a request
        admitted later in the same step then shares them; every backend writes a step's keys and values
        before any attention of the step reads them). Only known tokens count (not draft tokens)."""
        if not self.config.prefix_caching or request.cache_key is None:
            return
        filled = min(request.num_computed_tokens + num_new_tokens, request.num_known_tokens)
        full = filled // self.config.block_size
        if full <= request.num_cached_blocks:
            return
        hashes = block_hashes(request, full, self.config.block_size)
        for i in range(request.num_cached_blocks, full):
            self.allocator.register(request.block_ids[i], hashes[i])
        request.num_cached_blocks = full

    def _add_drafts(self, out: SchedulerOutput) -> None:
        """Decoding requests verify their drafts too, cut to the blocks they hold and the free ones above the
        watermark. Blocks taken for drafts that the model rejects stay with the request: it grows into them."""
        spare_slots = self.config.block_size * max(0, self.allocator.num_free - self.config.watermark_blocks)
        for index, item in enumerate(out.scheduled):
            request = item.request
            if not request.draft_ids:
                continue
            assert item.num_new_tokens == request.num_uncomputed_tokens == 1, "only a decoding request drafts"
            held_slots = len(request.block_ids) * self.config.block_size - request.num_tokens
            del request.draft_ids[max(0, held_slots + spare_slots) :]
            n = 1 + len(request.draft_ids)
            needed = self._blocks_needed(request, n)
            self._allocate(request, needed)
            spare_slots -= needed * self.config.block_size
            out.scheduled[index] = ScheduledRequest(request, n)

    def _take_slot(self, request: Request, out: SchedulerOutput) -> bool:
        adapter = request.adapter_key
        if not self.slots.may_admit(adapter):
            return False
        got = self.slots.acquire(adapter)
        if got is None:
            return False
        request.adapter_slot, install = got
        if install:
            out.installs.append((request.adapter_slot, adapter))
        return True

    # ---- helpers -------------------------------------------------------------------------------

    def _blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Token KV blocks to add so the request can compute `num_new_tokens` more."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, blocks_for(total, self.config.block_size) - len(request.block_ids))

    def _cross_blocks(self, request: Request) -> int:
        return blocks_for(request.num_states, self.config.block_size)

    def _missing_state_blocks(self, request: Request) -> int:
        """Blocks its states still need (all of them at admission, none while running)."""
        return 0 if request.cross_block_ids else self._cross_blocks(request)

    def _can_take(self, token_blocks: int, state_blocks: int) -> bool:
        if self.state_allocator is self.allocator:
            return self.allocator.can_allocate(token_blocks + state_blocks)
        return self.allocator.can_allocate(token_blocks) and self.state_allocator.can_allocate(state_blocks)

    def fits_alone(self, token_blocks: int, state_blocks: int) -> bool:
        """Whether a request needing these blocks fits the pools when nothing else holds any."""
        if self.state_allocator is self.allocator:
            return token_blocks + state_blocks <= self.config.num_blocks
        return token_blocks <= self.config.num_blocks and state_blocks <= self.config.num_state_blocks

    def _allocate(self, request: Request, needed: int) -> None:
        """`needed` more token blocks, and the request's state blocks when it has none yet."""
        if request.num_states and not request.cross_block_ids:
            request.cross_block_ids = self.state_allocator.allocate(self._cross_blocks(request))
            request.states_ready = False
        request.block_ids.extend(self.allocator.allocate(needed))

    def requeue(self, request: Request) -> None:
        """Put a running request back in the queue, as a preemption does (it could not run its step)."""
        assert request.status is RequestStatus.RUNNING, "only a running request is requeued"
        self._preempt(request)

    def _preempt(self, request: Request) -> Request:
        """Recompute preemption: forget the request's KV; it re-enters the queue at the front."""
        self.running.remove(request)
        self._release_blocks(request)
        self._release_slot(request)
        request.num_computed_tokens = 0
        request.draft_ids = []  # guessed for a step it no longer takes
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return request

    def _release_slot(self, request: Request) -> None:
        if request.adapter_key is not None:
            self.slots.release(request.adapter_key)
            request.adapter_slot = None

    def _release_blocks(self, request: Request) -> None:
        # Blocks registered for a step that did not complete (the request failed) were never filled.
        for block in request.block_ids[request.num_computed_tokens // self.config.block_size : request.num_cached_blocks]:
            self.allocator.unregister(block)
        self.allocator.free(request.block_ids[::-1])
        self.state_allocator.free(request.cross_block_ids)
        request.block_ids, request.cross_block_ids = [], []
        request.num_cached_blocks, request.states_ready = 0, False
