"""Speculative decoding on tiny random models: families whose attention differs from Llama's (MPT's ALiBi,
Mistral's sliding window, T5's relative bias and cross-attention with forced tokens) give the same greedy tokens
with drafts as without; and sampled tokens follow the model's exact distribution (a chi-square test over many
seeds on a Llama of 8 tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.loading import with_generation_config
from loraplex.params import SamplingParams
from tests.engine.speculation import StepLog
from tests.engine.test_speculative_units import chi_square_p_value
from tests.helpers import engine_for, full_logits, load_ours, ours_from_hf, tiny_hf_model, tiny_mpt, tiny_t5
from tests.models.conftest import one_thread  # noqa: F401 — the fixture, for usefixtures below

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 24


def repetitive_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random phrase (so there is something to look up), cut to each length."""
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        prompts.append((phrase * n)[:n])
    return prompts


def t5_with_forced_tokens(path):
    hf = tiny_t5(gated=False, seed=5)
    hf.generation_config.forced_bos_token_id = 7
    hf.generation_config.forced_eos_token_id = 9
    ours, config = load_ours(hf, path)
    return ours, with_generation_config(config, hf.generation_config.to_dict()), 300


FAMILIES = {
    "mpt-alibi": lambda path: (*load_ours(tiny_mpt(seed=1), path), 49152),
    "mistral-sliding-window": lambda path: (*ours_from_hf(tiny_hf_model("mistral", seed=2, sliding_window=6)), 256),
    "t5-forced-tokens": t5_with_forced_tokens,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_those_without_drafts(family, tmp_path):
    ours, config, vocab = FAMILIES[family](tmp_path)
    prompts = repetitive_prompts(vocab, [7, 30, 13, 21])
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in engine_for(ours, config).generate(prompts, params)]
    engine = engine_for(ours, config, speculative_tokens=5, block_size=8)  # verification rows cross blocks
    log = StepLog(engine)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    kept = [len(v.kept) for step in log.steps for v in step if v.num_drafts]
    assert engine.spec_decode.accepted_tokens > 0 and max(kept) >= 3, kept
    if family.startswith("t5"):
        assert all(w[0] == 7 and w[-1] == 9 for w in want)


def exact_cells(model, config, prompt: list[int], depth: int, floor: float) -> dict[tuple[int, ...], float]:
    """The model's probability of each continuation of `depth` tokens that has at least `floor` (temperature 1),
    found by expanding only the prefixes that still have `floor`."""
    cells: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        p = torch.softmax(full_logits(model, config, prompt + prefix)[-1].double(), dim=0).tolist()
        for token, pt in enumerate(p):
            if prob * pt < floor:
                continue
            if len(prefix) + 1 == depth:
                cells[(*prefix, token)] = prob * pt
            else:
                expand([*prefix, token], prob * pt)

    expand([], 1.0)
    return cells


def test_sampled_tokens_follow_the_models_distribution_and_equal_those_without_drafts():
    """4000 seeds, 4 tokens each at temperature 1 from a prompt that repeats all 8 tokens (every suffix is
    drafted): the same tokens with drafts as without, seed by seed; and the sequences' frequencies match the
    model's exact probabilities. Cells under 5 expected sequences are merged into one; the chi-square test runs
    at level 1e-4, so a correct implementation fails it for at most 1e-4 of all seed sets (these are fixed)."""
    hf = tiny_hf_model(vocab_size=8, seed=4)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # peakier distributions: more cells with enough mass to test
    ours, config = ours_from_hf(hf)
    prompt, depth, n = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1, 4, 1, 5], 4, 4000
    plist = [SamplingParams(max_new_tokens=depth, do_sample=True, seed=s, ignore_eos=True) for s in range(n)]
    without = [tuple(o.token_ids) for o in engine_for(ours, config).generate([prompt] * n, plist)]
    engine = engine_for(ours, config, speculative_tokens=3)
    assert [tuple(o.token_ids) for o in engine.generate([prompt] * n, plist)] == without
    assert engine.spec_decode.accepted_tokens > n // 10, engine.spec_decode

    cells = exact_cells(ours, config, prompt, depth, floor=5 / n)
    observed = [without.count(cell) for cell in cells]
    expected = [p * n for p in cells.values()]
    rest, rest_expected = n - sum(observed), n - sum(expected)
    if rest_expected >= 5:
        observed, expected = [*observed, rest], [*expected, rest_expected]
    else:  # too little mass left for a cell of its own: joined to the smallest
        smallest = expected.index(min(expected))
        observed[smallest] += rest
        expected[smallest] += rest_expected
    assert len(cells) >= 20, "the test needs cells to compare"
    assert chi_square_p_value(observed, expected) > 1e-4
