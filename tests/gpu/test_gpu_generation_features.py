"""Prefix caching and speculative decoding on a GPU (run on a CUDA machine: `python -m pytest tests/gpu`; not in
`make test`): a random-weight model of SmolLM2-135M's shape gives the same greedy tokens with each feature on
and off, exactly in float32. In bfloat16 GEMMs pick other kernels for other row counts, so near-ties may flip
(as for batch invariance, tests/gpu/test_gpu_parity.py): there each request must agree up to its first
difference, and that difference must be a near-tie of the reference (its two tokens' logprobs within `NEAR_TIE`)."""

import dataclasses
import random

import pytest
import torch

from loraplex.params import SamplingParams, TokenInfo
from tests.gpu.test_gpu_parity import DEVICE, DTYPES, SMOLLM2_SHAPE
from tests.helpers import engine_for, ours_from_hf, tiny_hf_model

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def model(request):
    hf = tiny_hf_model("llama", **SMOLLM2_SHAPE).to(DEVICE, request.param)
    ours, config = ours_from_hf(hf, device=DEVICE, dtype=request.param)
    return ours, config, request.param


# bfloat16 keeps 8 bits of mantissa: logits of a few units differ by ~0.05 between kernels; 0.25 nats is several
# times that, and far below the margin of a typical greedy choice of these random models.
NEAR_TIE = 0.25


def generated_tokens(engine, prompts, params) -> list[list[TokenInfo]]:
    """Every token of each request (with its logprob and top alternatives), in prompt order."""
    requests = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[TokenInfo]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            if out.token is not None:
                tokens[out.request_id].append(out.token)
    return [tokens[r.request_id] for r in requests]


def agree(reference: list[list[TokenInfo]], got: list[list[int]], dtype) -> None:
    """`got` equals the reference exactly (float32), or up to a near-tie of the reference (bfloat16)."""
    expected = [[t.id for t in tokens] for tokens in reference]
    same = sum(a == b for a, b in zip(expected, got))
    print(f"{dtype}: {same}/{len(expected)} requests identical")
    if dtype is torch.float32:
        assert got == expected
        return
    for tokens, ids in zip(reference, got):
        i = next((i for i, (t, g) in enumerate(zip(tokens, ids)) if t.id != g), None)
        if i is None:
            assert len(ids) == len(tokens)
            continue
        alternatives = {alt.id: alt.logprob for alt in tokens[i].top_tokens}
        assert ids[i] in alternatives, f"token {i}: {ids[i]} is not among the reference's top tokens"
        gap = tokens[i].logprob - alternatives[ids[i]]
        print(f"  first difference at token {i}: a gap of {gap:.3f} nats")
        assert gap <= NEAR_TIE, f"token {i}: the reference preferred its token by {gap:.3f} nats"


def test_prefix_caching_on_and_off(model):
    ours, config, dtype = model
    rng = random.Random(0)
    system = [rng.randrange(49152) for _ in range(300)]
    prompts = [system + [rng.randrange(49152) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, top_n_tokens=4)
    off = generated_tokens(engine_for(ours, config, device=DEVICE, dtype=dtype, prefix_caching=False), prompts, params)
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype)
    on = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    assert engine.scheduler.prefix_hits >= 15 * 288
    agree(off, [r.token_ids for r in on], dtype)


def test_speculative_decoding_on_and_off(model):
    ours, config, dtype = model
    rng = random.Random(1)
    # Repetitive prompts: n-gram lookup finds drafts in them (and in the loops greedy random models fall into).
    prompts = [[rng.randrange(49152) for _ in range(20)] * 4 for _ in range(8)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    off = generated_tokens(engine_for(ours, config, device=DEVICE, dtype=dtype), prompts,
                           dataclasses.replace(params, top_n_tokens=4))
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype, speculative_tokens=4)
    on = engine.generate(prompts, params)
    print(f"{dtype}: drafted {engine.spec_decode.draft_tokens}, accepted {engine.spec_decode.accepted_tokens}")
    assert engine.spec_decode.draft_tokens > 0
    agree(off, [r.token_ids for r in on], dtype)


def test_constrained_rows_beside_plain_ones_under_graphs():
    """OpenAI's logit_bias and vLLM's allowed_token_ids, bad_words and min_tokens (engine/sampling/constraints.py) on
    a CUDA engine whose decode steps replay graphs, in one batch with plain requests: each request's tokens are those
    it gets alone (float32: exactly), each restriction holds, and no row's bias or mask reaches another."""
    hf = tiny_hf_model("llama", **SMOLLM2_SHAPE).to(DEVICE, torch.float32)
    ours, config = ours_from_hf(hf, device=DEVICE, dtype=torch.float32)
    engine = engine_for(ours, config, device=DEVICE, dtype=torch.float32)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
    free = [r.token_ids for r in engine.generate(prompts, plain)]
    allowed = tuple(sorted({t for tokens in free for t in tokens[:3]}))[:5]
    params = [
        plain,
        dataclasses.replace(plain, logit_bias=((7, 100.0),)),  # forced: every token is 7
        dataclasses.replace(plain, allowed_token_ids=allowed),
        dataclasses.replace(plain, bad_words_ids=((free[3][0],),)),  # the free answer's first token, never
        dataclasses.replace(plain, min_tokens=12, min_tokens_stops=(free[4][0],)),  # masked for all 12
        plain,
    ]
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    captured = engine.runner.decode_graphs.num_captured
    together = [r.token_ids for r in engine.generate(prompts, params)]
    assert captured > 0 and together == alone
    assert together[0] == free[0] and together[5] == free[5]  # plain rows untouched by their neighbours' constraints
    assert together[1] == [7] * 12
    assert set(together[2]) <= set(allowed)
    assert free[3][0] not in together[3]
    assert free[4][0] not in together[4] and len(together[4]) == 12
