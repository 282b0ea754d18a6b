"""LoRA on encoder-decoder models: PEFT adapters on the encoder only, the decoder's self-attention and
feed-forward only, the cross-attention only, and everything, give PEFT's greedy tokens through the engine
(the cross-attention's k/v see encoder rows: they take each request's adapter through the `states` rows);
a batch mixing them and the base model equals each request alone, in both LoRA forms."""

from __future__ import annotations

import random

import pytest

from loraplex.params import SamplingParams
from tests.helpers import engine_for, hf_seq2seq_greedy, load_ours, tiny_t5
from tests.lora.peft_helpers import peft_model, save_and_load

NEW = 8
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
T5_CASES = {
    "encoder": dict(r=4, lora_alpha=8, target_modules=r"encoder\..*\.(q|k|v|o|wi_0|wi_1|wo)"),
    "decoder": dict(r=8, lora_alpha=8, target_modules=r"decoder\..*(SelfAttention\.(q|k|v|o)|DenseReluDense\.(wi_0|wi_1|wo))"),
    "cross": dict(r=4, lora_alpha=16, target_modules=r".*EncDecAttention\.(q|k|v|o)"),
    "cross-kv": dict(r=4, lora_alpha=16, target_modules=r".*EncDecAttention\.(k|v)"),
    "all": dict(r=8, lora_alpha=16, target_modules=["q", "k", "v", "o", "wi_0", "wi_1", "wo"]),
}


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    hf = tiny_t5(gated=True, seed=7)
    ours, config = load_ours(hf, tmp_path_factory.mktemp("t5"))
    return hf, ours, config


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(2, 40))] + [1] for _ in range(4)]


@pytest.fixture(scope="module")
def adapters(t5, prompts, tmp_path_factory):
    hf, ours, config = t5
    shapes = engine_for(ours, config, max_active_adapters=1).lora.base_shapes
    out = {}
    for seed, (name, kwargs) in enumerate(T5_CASES.items()):
        model = peft_model(hf, seed=seed + 1, **kwargs)
        adapter = save_and_load(model, tmp_path_factory.mktemp(name), name, shapes)
        out[name] = (adapter, [hf_seq2seq_greedy(model, p, NEW) for p in prompts])
    return out


@pytest.mark.parametrize("case", T5_CASES)
def test_lora_on_t5_matches_peft(t5, prompts, adapters, case):
    hf, ours, config = t5
    adapter, want = adapters[case]
    engine = engine_for(ours, config, max_active_adapters=2)
    got = [o.token_ids for o in engine.generate(prompts, PARAMS, adapters=[adapter] * len(prompts))]
    assert got == want
    assert got != [hf_seq2seq_greedy(hf, p, NEW) for p in prompts], f"{case} changes nothing: the test proves nothing"


def test_row_kinds_of_t5_modules(t5):
    from loraplex.lora.layers import row_kind

    assert row_kind("encoder.block.1.layer.0.SelfAttention.q") == "encoder"
    assert row_kind("encoder.block.0.layer.1.DenseReluDense.wo") == "encoder"
    assert row_kind("decoder.block.0.layer.1.EncDecAttention.k") == "states"
    assert row_kind("decoder.block.0.layer.1.EncDecAttention.q") == "tokens"
    assert row_kind("decoder.block.2.layer.2.DenseReluDense.wi_0") == "tokens"
    assert row_kind("lm_head") == "logits"


def test_mixed_adapters_and_base_on_t5(t5, prompts, adapters):
    hf, ours, config = t5
    base = [hf_seq2seq_greedy(hf, p, NEW) for p in prompts]
    variants = [(None, base), *adapters.values()]
    jobs = [(p, a, want[i]) for i, p in enumerate(prompts) for a, want in variants]
    random.Random(2).shuffle(jobs)
    for threshold in (0, 10**6):  # the segmented form, then the stacked form for every decode step
        engine = engine_for(ours, config, max_active_adapters=len(variants))
        engine.runner.stacked_rows_per_segment = threshold
        outs = engine.generate([p for p, _, _ in jobs], PARAMS, adapters=[a for _, a, _ in jobs])
        assert [o.token_ids for o in outs] == [w for _, _, w in jobs], threshold
