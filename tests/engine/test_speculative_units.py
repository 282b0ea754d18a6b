"""Speculative decoding's parts on their own: the n-gram proposer, the draft limit, the scheduler's handling of
drafts (no torch, no model), and the verification of drafts on given logits."""

from __future__ import annotations

import math
import random

import torch

from loraplex.engine.requests.request import Request
from loraplex.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sampling.speculative import draft_limit, propose
from loraplex.engine.sampling.verification import accepted_prefix, sample_verified
from loraplex.params import SamplingParams
from loraplex.engine.sampling.sampler import Sampler
from tests.engine.speculation import chi_square_p_value

# ---- proposer ---------------------------------------------------------------------------------------------


def test_proposes_what_followed_the_last_tokens_before():
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], 10) == [4, 5, 9, 2, 3]  # up to the end of the tokens


def test_a_longer_match_beats_a_more_recent_one():
    # The suffix [7, 8, 9] occurred once, early; [9] alone occurred more recently, followed by 5.
    assert propose([7, 8, 9, 1, 2, 6, 9, 5, 7, 8, 9], 2) == [1, 2]


def test_the_most_recent_occurrence_wins_among_equally_long_matches():
    assert propose([4, 5, 1, 4, 5, 2, 4, 5], 1) == [2]
    assert propose([4, 5, 1, 4, 5, 2, 4, 5], 1, max_ngram=1, min_ngram=1) == [2]


def test_matches_are_at_most_max_ngram_long():
    # Both occurrences match the last 3 tokens; the longer match of the first one does not count past 3.
    tokens = [1, 2, 3, 4, 10, 9, 2, 3, 4, 11, 1, 2, 3, 4]
    assert propose(tokens, 1) == [11]
    assert propose(tokens, 1, max_ngram=4) == [10]


def test_nothing_to_propose():
    assert propose([1, 2, 3, 4], 3) == []  # the last token never occurred before
    assert propose([1, 2, 3, 4, 5, 4], 3) == []  # only a one-token match: too weak a guess by default
    assert propose([1, 2, 3, 4, 5, 4], 3, min_ngram=1) == [5, 4]
    assert propose([5], 3) == []
    assert propose([1, 2, 1], 0) == []
    assert propose([1, 2, 9, 1, 2], 2, min_ngram=3) == []  # only a 2-token match exists
    assert propose([1, 2, 9, 1, 2], 2, min_ngram=2) == [9, 1]


def test_a_run_proposes_from_the_latest_occurrence_with_a_full_continuation():
    assert propose([3, 3, 3], 4) == [3]  # the only 2-token match, [3, 3] ending at index 1, has one follower
    assert propose([6, 1, 1, 1, 1, 1, 1], 2) == [1, 1]  # not [1]: the latest match overlaps the end
    assert propose([8, 9, 8, 9, 8, 9, 8, 9], 3) == [8, 9, 8]
    # Among equally long matches with enough followers, still the most recent.
    assert propose([4, 5, 1, 2, 4, 5, 6, 7, 4, 5], 2) == [6, 7]


def test_draft_limit_keeps_room_for_the_bonus_token():
    # 10 tokens, 3 generated of at most 8: the step may add 5 tokens, so 4 drafts and the bonus.
    assert draft_limit(10, 3, 8, 100) == 4
    assert draft_limit(10, 3, 8, 12) == 1  # max total tokens binds first
    assert draft_limit(10, 7, 8, 100) == 0  # one token left: no draft
    assert draft_limit(10, 8, 8, 100) == 0


# ---- scheduler ----------------------------------------------------------------------------------------------


def decoding(scheduler: Scheduler, *prompt_lens: int) -> list[Request]:
    """Requests a, b, ... (one per prompt length) admitted in one step, their prompts computed and one token
    sampled each: they decode from now on."""
    requests = [Request(chr(97 + i), list(range(1, n + 1)), SamplingParams(max_new_tokens=8), 0, 0.0)
                for i, n in enumerate(prompt_lens)]
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()
    assert [item.request for item in out.scheduled] == requests
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_new_tokens
        item.request.output_ids.append(7)
    return requests


def test_a_request_with_drafts_is_scheduled_for_them_with_their_blocks():
    s = Scheduler(SchedulerConfig(num_blocks=10, block_size=4))
    (a,) = decoding(s, 4)  # 5 tokens, 4 computed, 1 block
    a.draft_ids = [1, 2, 3, 4]
    (item,) = s.schedule().scheduled
    assert item.num_new_tokens == 5 and item.num_drafts == 4 and item.completes_sequence
    assert len(a.block_ids) == 3  # positions 4..8


def test_drafts_are_cut_to_free_blocks_and_never_preempt():
    # 4 blocks of 4: a holds 1 (4 computed, its next token needs the last free block), b holds 2 and its
    # next token fills them.
    s = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    a, b = decoding(s, 4, 7)
    a.draft_ids, b.draft_ids = [1, 2, 3, 4, 5], [1, 2, 3]
    out = s.schedule()
    assert not out.preempted and s.allocator.num_free == 0
    # a's second block has room for its token and 3 drafts; b's has room for its token only.
    assert {i.request.request_id: i.num_drafts for i in out.scheduled} == {"a": 3, "b": 0}
    assert a.draft_ids == [1, 2, 3] and b.draft_ids == []


def test_drafts_leave_the_watermark_free_and_come_after_admission():
    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, watermark_blocks=2))
    (a,) = decoding(s, 8)  # 2 blocks
    a.draft_ids = list(range(20))
    s.add(Request("new", [1, 2, 3, 4], SamplingParams(max_new_tokens=4), 0, 0.0))
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["a", "new"]
    # a's token took a block and "new" one; 2 stay free for the watermark: a gets the 3 free slots of its third
    # block and 2 more blocks.
    assert out.scheduled[0].num_drafts == 3 + 2 * 4 and s.allocator.num_free == 2


def test_preemption_drops_drafts():
    s = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    a, b = decoding(s, 8, 8)  # 2 blocks each, full: each next token needs a third
    b.draft_ids = [1, 2]
    out = s.schedule()  # a takes a block b gives up: b, the most recent, is preempted
    assert out.preempted == [b] and b.draft_ids == [] and [i.request for i in out.scheduled] == [a]


# ---- verification -------------------------------------------------------------------------------------------


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 1]) == 1
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_prefix([], [4]) == 0


def sequential(sampler, rows: torch.Tensor, params: SamplingParams, prompt: list[int], seed: int) -> list[int]:
    """Decoding without drafts, each step's logits given: row j is sampled after the tokens drawn before it."""
    output: list[int] = []
    for row in rows:
        output.append(sampler(row[None].clone(), [params], [prompt], [list(output)], [seed]).token_ids[0])
    return output


def test_verification_keeps_exactly_the_tokens_decoding_without_drafts_draws():
    """Random logits and drafts (some right, some wrong), greedy and sampled rows with penalties: the kept
    tokens are the first tokens sequential decoding draws, up to and including its first disagreement."""
    rng = random.Random(0)
    torch.manual_seed(0)
    sampler = Sampler()
    kinds = [
        SamplingParams(max_new_tokens=9, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=9, do_sample=True, temperature=0.9, top_k=6, frequency_penalty=0.7),
        SamplingParams(max_new_tokens=9, do_sample=True, presence_penalty=1.0, repetition_penalty=1.3),
    ]
    kept_lengths = set()
    for trial in range(60):
        params, seed = kinds[trial % len(kinds)], rng.randrange(1 << 30)
        prompt = [rng.randrange(10) for _ in range(5)]
        k = rng.randrange(0, 5)
        rows = torch.randn(k + 1, 10) * 2
        truth = sequential(sampler, rows, params, prompt, seed)
        # Drafts: the true tokens, each replaced by a wrong one with probability 0.2.
        drafts = [t if rng.random() < 0.8 else (t + 1) % 10 for t in truth[:k]]
        (kept,) = sample_verified(sampler, rows.clone(), [params], [prompt], [[]], [seed], [drafts])
        accepted = accepted_prefix(drafts, truth)
        assert [t.token_id for t in kept] == truth[: accepted + 1]
        kept_lengths.add(len(kept))
    assert kept_lengths >= {1, 2, 3, 4, 5}, "every acceptance length should occur"


def test_verification_is_rejection_sampling_on_given_probabilities():
    """One draft d over 6 tokens, temperature 1, 6000 seeds: the first kept token follows p; d is accepted
    with probability p(d); after a rejection the token follows p without d, renormalised; after an
    acceptance the bonus token follows the next row's q.

    Each check is a chi-square (or binomial) test at level 1e-4, four of them: a correct implementation fails
    for at most 4e-4 of all seed sets (these seeds are fixed, so the outcome is too)."""
    p = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    q = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.15, 0.2])
    draft, n, vocab = 1, 6000, 6
    logits = torch.stack([p.log(), q.log()]).repeat(n, 1)
    params = SamplingParams(max_new_tokens=9, do_sample=True)
    kept = sample_verified(Sampler(), logits, [params] * n, [[0]] * n, [[]] * n, list(range(n)), [[draft]] * n)
    first = [k[0].token_id for k in kept]
    counts = [first.count(t) for t in range(vocab)]
    assert chi_square_p_value(counts, (p * n).tolist()) > 1e-4
    accepted = [k for k in kept if len(k) == 2]
    assert all(k[0].token_id == draft for k in accepted) and all(len(k) == 1 for k in kept if k[0].token_id != draft)
    # Acceptance rate: within 3.9 standard deviations of p(d) (two-sided 1e-4).
    sd = math.sqrt(n * p[draft] * (1 - p[draft]))
    assert abs(len(accepted) - n * p[draft]) < 3.9 * sd
    rejected = [t for t in first if t != draft]
    rest = torch.cat([p[:draft], p[draft + 1 :]])
    rest_counts = [rejected.count(t) for t in range(vocab) if t != draft]
    assert chi_square_p_value(rest_counts, (rest / rest.sum() * len(rejected)).tolist()) > 1e-4
    bonus = [k[1].token_id for k in accepted]
    assert chi_square_p_value([bonus.count(t) for t in range(vocab)], (q * len(accepted)).tolist()) > 1e-4
    # Each kept token's logprob is its own row's.
    assert math.isclose(accepted[0][1].logprob, math.log(q[bonus[0]]), rel_tol=1e-4)
