"""Sampler: penalties, filters (parity with transformers' warpers), seeded draws, reported logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from loraplex.engine.sampling import sampler as sampling
from loraplex.params import SamplingParams
from loraplex.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    _apply_penalties,
    _draw,
    _draw_key,
    _filter,
    token_scores,
)

sampler = Sampler()
_NEG = float("-inf")


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    prompts: list[list[int]] | None = None,
) -> SamplerOutput:
    n = logits.shape[0]
    outputs = [[0] * s for s in steps] if steps is not None else [[] for _ in range(n)]
    return sampler(logits, params, prompts or [[] for _ in range(n)], outputs, seeds or list(range(n)))


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int, step: int = 0) -> list[int]:
    """One draw for each of n seeds (rows are independent, so one batch of n copies does it)."""
    batch = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return run(batch, [params] * n, seeds=list(range(1000, 1000 + n)), steps=[step] * n).token_ids


def random_logits(n: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


# ------------------------------------------------------------------------------------------ greedy


def test_greedy_is_argmax_and_reports_log_softmax() -> None:
    logits = random_logits(6, 300, 2.0, 0)
    out = run(logits, [SamplingParams(top_n_tokens=3)] * 6)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    expected = torch.log_softmax(logits, dim=1)
    for row, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp == pytest.approx(expected[row, tok].item(), abs=1e-5)


def test_greedy_in_mixed_batch_and_low_precision_input() -> None:
    logits = random_logits(4, 500, 3.0, 1).to(torch.bfloat16)
    params = [SamplingParams(), SamplingParams(do_sample=True, top_k=5), SamplingParams(), SamplingParams(top_p=0.5)]
    out = run(logits, params)
    argmax = logits.float().argmax(dim=1)
    assert out.token_ids[0] == argmax[0] and out.token_ids[2] == argmax[2]


def test_caller_logits_are_not_modified() -> None:
    logits = random_logits(3, 200, 2.0, 2)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(top_k=3, top_p=0.8, typical_p=0.9, min_p=0.05),
        SamplingParams(do_sample=True),
    ]
    run(logits, params, prompts=[[1, 2, 3]] * 3, steps=[4, 4, 4])
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------------------ penalties


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, top_n_tokens=5)
    out = sampler(logits, [params], [[0]], [[1, 1, 3]], [0])
    # repetition over prompt+output {0, 1, 3}: 2/2, -1*2, 3/2; then frequency/presence over the output only:
    # token 1 seen twice: -2 - 2*0.5 - 0.25; token 3 once: 1.5 - 0.5 - 0.25; token 0 (prompt only) untouched.
    expected = torch.tensor([1.0, -3.25, 0.5, 0.75, 0.0])
    assert out.token_ids == [0]  # greedy: argmax after penalties (was token 3 before)
    reported = dict(out.top_tokens[0])
    want = torch.log_softmax(expected, dim=0)
    for tok in range(5):
        assert reported[tok] == pytest.approx(want[tok].item(), abs=1e-6)


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(3, 1000, 3.0, 3)
    seqs = [[5, 7, 7, 999, 0], [1], list(range(0, 1000, 3))]
    for penalty in (0.7, 1.3):
        ours = _apply_penalties(
            logits.clone(),
            logits,
            [SamplingParams(repetition_penalty=penalty)] * 3,
            [s[:2] for s in seqs],
            [s[2:] for s in seqs],
        )
        proc = RepetitionPenaltyLogitsProcessor(penalty)
        for row, seq in enumerate(seqs):
            ref = proc(torch.tensor([seq]), logits[row : row + 1].clone())
            torch.testing.assert_close(ours[row : row + 1], ref, rtol=0, atol=0)


def test_frequency_and_presence_only_count_generated_tokens() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    out = _apply_penalties(logits.clone(), logits, [params], [[0, 0, 4]], [[2, 2, 2, 5]])
    assert out[0].tolist() == [0.0, 0.0, -3.5, 0.0, 0.0, -1.5]


def test_penalty_ignores_ids_outside_vocab() -> None:
    logits = torch.ones(1, 4)
    out = _apply_penalties(logits.clone(), logits, [SamplingParams(repetition_penalty=2.0)], [[1, 10]], [[]])
    assert out[0].tolist() == [1.0, 0.5, 1.0, 1.0]


# ------------------------------------------------------------------------------------------ filters vs transformers


def hf_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in the order GenerationMixin applies them."""
    warpers = []
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(p.typical_p))
    out = logits.clone()
    for w in warpers:
        out = w(torch.zeros(1, 1, dtype=torch.long), out)
    return out


PARITY_PARAMS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=40),
    SamplingParams(top_p=0.05),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.95),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.5),
    SamplingParams(typical_p=0.2),
    SamplingParams(typical_p=0.9),
    SamplingParams(top_k=100, top_p=0.9),
    SamplingParams(top_k=50, top_p=0.8, min_p=0.02, typical_p=0.95),
]


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # flat (full sort), medium and peaked (short prefix) rows
def test_filters_match_transformers(scale: float) -> None:
    vocab = 3000
    logits = random_logits(len(PARITY_PARAMS), vocab, scale, int(scale * 10))
    ours = logits.clone()
    _filter(ours, PARITY_PARAMS)
    for row, p in enumerate(PARITY_PARAMS):
        ref = hf_filter(logits[row : row + 1], p)[0]
        kept = torch.isfinite(ours[row])
        assert torch.equal(kept, torch.isfinite(ref)), (
            f"{p} keeps {int(kept.sum())} vs {int(torch.isfinite(ref).sum())}"
        )
        assert torch.equal(ours[row][kept], logits[row][kept])  # survivors are untouched
        assert kept.any()


def test_top_k_keeps_ties_and_filters_keep_at_least_one_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    x = logits.clone()
    _filter(x, [SamplingParams(top_k=2), SamplingParams(top_p=1e-6, typical_p=1e-6, min_p=0.999)])
    assert torch.isfinite(x[0]).tolist() == [False, True, True, False, True]  # as HF: ties with the k-th survive
    assert torch.isfinite(x[1]).tolist() == [True, False, False, False, False]


def test_top_p_boundary_and_ties() -> None:
    # Dyadic probabilities are exact in float32, so the mass reaches top_p exactly.
    logits = torch.tensor([[0.125, 0.5, 0.125, 0.25]]).log()
    kept = {}
    for top_p in (0.5, 0.75, 0.875):
        x = logits.clone()
        _filter(x, [SamplingParams(top_p=top_p)])
        kept[top_p] = torch.isfinite(x[0]).tolist()
    # As HF: the token at which the mass reaches top_p is kept, the next one is not.
    assert kept[0.5] == [False, True, False, False]
    assert kept[0.75] == [False, True, False, True]
    # Where the cut falls inside a tie, both tied tokens stay (HF keeps an arbitrary one): batch-invariant.
    assert kept[0.875] == [True, True, True, True]


@pytest.mark.parametrize("prefix_sizes", [(), (3,), (40, 700)])
def test_prefix_search_matches_full_sort(monkeypatch: pytest.MonkeyPatch, prefix_sizes: tuple[int, ...]) -> None:
    logits = torch.cat([random_logits(len(PARITY_PARAMS), 1000, scale, 11) for scale in (0.3, 2.0, 8.0)])
    params = PARITY_PARAMS * 3
    default = logits.clone()
    _filter(default, params)
    monkeypatch.setattr(sampling, "_PREFIX_SIZES", prefix_sizes)
    other = logits.clone()
    _filter(other, params)
    assert torch.equal(default, other)


# ------------------------------------------------------------------------------------------ draws stay in the kept set


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_draws_follow_the_distribution_across_blocks() -> None:
    # 700 tokens: blocks of 256, the last one partial, holding 10%, 30% and 60% of the mass; token 1 weighs 0.
    probs = torch.softmax(random_logits(1, 700, 1.0, 13)[0], dim=0)
    probs[1] = 0.0
    for block, mass in zip(torch.split(probs, 256), (0.1, 0.3, 0.6)):
        block *= mass / block.sum()
    n = 6000
    drawn = _draw(probs.log().expand(n, -1).contiguous(), [_draw_key(seed, 0) for seed in range(n)])
    assert not (drawn == 1).any()  # probability 0 (a removed token) is never drawn
    # Buckets of 100 ids straddle the blocks: each bucket's share matches its mass.
    got = torch.bincount(drawn // 100, minlength=7).double() / n
    want = probs.double().view(7, 100).sum(dim=1)
    sigma = torch.sqrt(want * (1 - want) / n)
    assert torch.all((got - want).abs() <= 5 * sigma), (got, want)


def test_draw_picks_only_kept_tokens_in_sparse_rows() -> None:
    x = torch.full((3, 600), _NEG)
    x[0, 599] = 0.0  # only the last token, in the partial last block
    x[1, [3, 300]] = torch.tensor([0.0, 5.0])
    x[2, [0, 256, 599]] = 1.0
    for seed in range(50):
        tokens = _draw(x, [_draw_key(seed, 0)] * 3).tolist()
        assert tokens[0] == 599 and tokens[1] in (3, 300) and tokens[2] in (0, 256, 599)


def test_draw_of_a_row_does_not_depend_on_the_batch() -> None:
    x = random_logits(40, 3000, 1.0, 12)
    keys = [_draw_key(seed, 3) for seed in range(40)]
    batched = _draw(x, keys)
    for i in (0, 17, 39):
        assert _draw(x[i : i + 1], keys[i : i + 1]).item() == batched[i].item()
    assert torch.equal(_draw(x[10:30], keys[10:30]), batched[10:30])


def test_draw_is_stable_under_rounding_noise_in_the_logits() -> None:
    # Batched and unbatched forwards give logits that differ in the last bits. A race only changes its winner
    # when the two best scores are that close; an inverse-CDF draw over this row flips ~10% of these draws.
    n, vocab = 500, 20000
    x = random_logits(1, vocab, 2.0, 14).expand(n, -1).contiguous()
    nudged = x + random_logits(n, vocab, 1e-3, 15)
    keys = [_draw_key(seed, 0) for seed in range(n)]
    assert (_draw(x, keys) != _draw(nudged, keys)).sum().item() <= n // 100


def nucleus(logits_row: torch.Tensor, top_p: float) -> set[int]:
    probs = torch.softmax(logits_row.double(), dim=0)
    kept, mass = set(), 0.0
    for tok in torch.argsort(probs, descending=True).tolist():
        kept.add(tok)
        mass += probs[tok].item()
        if mass >= top_p:
            break
    return kept


def test_top_k_draws_stay_in_top_k() -> None:
    row = random_logits(1, 2000, 1.0, 4)[0]
    allowed = set(torch.topk(row, 7).indices.tolist())
    drawn = sample_many(row, SamplingParams(top_k=7), 400)
    assert set(drawn) <= allowed
    assert len(set(drawn)) == 7  # a flat-ish top-7: every one of them comes up in 400 draws


def test_top_p_draws_stay_in_nucleus() -> None:
    row = random_logits(1, 2000, 2.5, 5)[0]
    for top_p in (0.3, 0.9):
        allowed = nucleus(row, top_p)
        drawn = sample_many(row, SamplingParams(top_p=top_p), 300)
        assert set(drawn) <= allowed
        assert len(set(drawn)) > 1


def test_min_p_and_typical_draws_stay_in_kept_set() -> None:
    row = random_logits(1, 2000, 2.5, 6)[0]
    probs = torch.softmax(row, dim=0)
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    drawn = sample_many(row, SamplingParams(min_p=0.1), 300)
    assert set(drawn) <= allowed and len(set(drawn)) > 1
    allowed = set(
        torch.nonzero(torch.isfinite(hf_filter(row[None], SamplingParams(typical_p=0.5))[0])).flatten().tolist()
    )
    drawn = sample_many(row, SamplingParams(typical_p=0.5), 300)
    assert set(drawn) <= allowed and len(set(drawn)) > 1


def test_temperature_sharpens_and_flattens() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    cold = sample_many(probs.log(), SamplingParams(temperature=0.25), 2000)
    hot = sample_many(probs.log(), SamplingParams(temperature=4.0), 2000)
    # p**4 renormalised: token 0 has ~0.94; p**0.25: token 2 has ~0.25.
    assert cold.count(0) / 2000 > 0.9
    assert 0.2 < hot.count(2) / 2000 < 0.3


# ------------------------------------------------------------------------------------------ seeds and batch invariance


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_token_alone_and_anywhere_in_any_batch(device: str) -> None:
    vocab = 3000
    target = random_logits(1, vocab, 1.5, 7).to(device)
    others = random_logits(9, vocab, 4.0, 8).to(device)
    configs = [
        SamplingParams(do_sample=True),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(top_p=0.95),
        SamplingParams(typical_p=0.8, min_p=0.01),
        SamplingParams(temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.3, top_n_tokens=2),
    ]
    other_params = [
        SamplingParams(),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5, temperature=0.5),
        SamplingParams(typical_p=0.3),
        SamplingParams(do_sample=True),
    ]
    prompt, generated = [3, 9, 27], [81, 3, 5, 5]
    for params in configs:
        for seed in range(4):
            alone = sampler(target, [params], [prompt], [generated], [seed])
            for pos in (0, 4, 9):
                batch = torch.cat([others[:pos], target, others[pos:]])
                ps = [other_params[i % len(other_params)] for i in range(10)]
                ps[pos] = params
                prompts = [[i] * i for i in range(10)]
                outs = [[i + 1] * (i % 3) for i in range(10)]
                prompts[pos], outs[pos] = prompt, generated
                seeds = [seed + 100 + i for i in range(10)]
                seeds[pos] = seed
                out = sampler(batch, ps, prompts, outs, seeds)
                assert out.token_ids[pos] == alone.token_ids[0], (params, seed, pos)
                assert out.logprobs[pos] == alone.logprobs[0]
                assert out.top_tokens[pos] == alone.top_tokens[0]


def test_draws_depend_on_seed_and_step() -> None:
    row = torch.zeros(1, 1000)  # uniform: any two different uniforms almost surely pick different tokens
    params = SamplingParams(do_sample=True)
    by_step = [sampler(row, [params], [[]], [[0] * step], [42]).token_ids[0] for step in range(20)]
    assert len(set(by_step)) >= 15
    by_seed = [sampler(row, [params], [[]], [[]], [seed]).token_ids[0] for seed in range(20)]
    assert len(set(by_seed)) >= 15
    # ...and the same (seed, step) again gives the same token (a recomputed request redraws its tokens).
    assert by_step == [sampler(row, [params], [[]], [[7] * step], [42]).token_ids[0] for step in range(20)]


# ------------------------------------------------------------------------------------------ reported logprobs


def test_logprobs_and_top_tokens_are_pre_filter_log_softmax() -> None:
    logits = random_logits(4, 800, 2.0, 9)
    params = [
        SamplingParams(temperature=0.5, top_k=10, top_n_tokens=5),
        SamplingParams(top_p=0.5, top_n_tokens=1),
        SamplingParams(top_n_tokens=0),
        SamplingParams(temperature=2.0, typical_p=0.5, top_n_tokens=3),
    ]
    out = run(logits, params, seeds=[1, 2, 3, 4])
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    expected = torch.log_softmax(logits / temps, dim=1)
    for row, p in enumerate(params):
        assert out.logprobs[row] == pytest.approx(expected[row, out.token_ids[row]].item(), abs=1e-5)
        top = out.top_tokens[row]
        assert len(top) == p.top_n_tokens
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert [t for t, _ in top] == torch.topk(expected[row], p.top_n_tokens).indices.tolist()
        for tok, lp in top:
            assert lp == pytest.approx(expected[row, tok].item(), abs=1e-5)
    assert all(math.isfinite(lp) for lp in out.logprobs)


def test_top_tokens_capped_at_vocab() -> None:
    out = run(torch.tensor([[0.0, 1.0, 2.0]]), [SamplingParams(top_n_tokens=10)])
    assert [t for t, _ in out.top_tokens[0]] == [2, 1, 0]


def test_token_scores() -> None:
    """Each row's logprob of its id, its rank (vLLM's: how many tokens score at least as high) and the top k."""
    logits = random_logits(600, 50, 3.0, 10).to(torch.bfloat16)  # more rows than one chunk
    ids = torch.randint(0, 50, (600,), generator=torch.Generator().manual_seed(0))
    got, ranks, top_values, top_ids = token_scores(logits, ids, 5)
    assert got.dtype == torch.float32 and got.shape == (600,) and top_ids.shape == (600, 5)
    lp = torch.log_softmax(logits.float(), dim=1)
    want = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got, want)
    assert torch.equal(ranks, (lp >= want.unsqueeze(1)).sum(dim=1)) and int(ranks.min()) >= 1
    order = lp.argsort(dim=1, descending=True, stable=True)
    assert torch.equal(top_values, lp.gather(1, order[:, :5]))  # best first (ties: any of the tied ids)
    torch.testing.assert_close(lp.gather(1, top_ids), top_values)
    best = lp.argmax(dim=1)
    assert torch.all(token_scores(logits, best, 0)[1] == (lp >= lp.max(dim=1, keepdim=True).values).sum(dim=1))
