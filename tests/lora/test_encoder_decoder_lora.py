"""LoRA on encoder-decoder models (T5, BART): PEFT adapters on the encoder only, the decoder's
self-attention and feed-forward only, the cross-attention only (and its k/v alone), and everything, give
PEFT's greedy tokens through the engine (the cross-attention's k/v see encoder rows: they take each
request's adapter through the `states` rows); a batch mixing them and the base model equals each request
alone, in both LoRA forms."""

from __future__ import annotations

import random

import pytest

from loraplex.lora.step.layers import row_kind
from loraplex.params import SamplingParams
from tests.helpers import engine_for, hf_seq2seq_greedy, load_ours, tiny_t5
from tests.lora.peft_helpers import peft_model, save_and_load
from tests.models.test_bart_parity import tiny_bart

NEW = 8
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
CASES = {
    "t5": {
        "encoder": dict(r=4, lora_alpha=8, target_modules=r"encoder\..*\.(q|k|v|o|wi_0|wi_1|wo)"),
        "decoder": dict(r=8, lora_alpha=8, target_modules=r"decoder\..*(SelfAttention\.(q|k|v|o)|DenseReluDense\.(wi_0|wi_1|wo))"),
        "cross": dict(r=4, lora_alpha=16, target_modules=r".*EncDecAttention\.(q|k|v|o)"),
        "cross-kv": dict(r=4, lora_alpha=16, target_modules=r".*EncDecAttention\.(k|v)"),
        "all": dict(r=8, lora_alpha=16, target_modules=["q", "k", "v", "o", "wi_0", "wi_1", "wo"]),
    },
    "bart": {
        "encoder": dict(r=4, lora_alpha=8, target_modules=r"model\.encoder\..*(q_proj|k_proj|v_proj|out_proj|fc1|fc2)"),
        "decoder": dict(r=8, lora_alpha=8, target_modules=r"model\.decoder\..*(self_attn\.(q_proj|k_proj|v_proj|out_proj)|fc1|fc2)"),
        "cross": dict(r=4, lora_alpha=16, target_modules=r".*encoder_attn\.(q_proj|k_proj|v_proj|out_proj)"),
        "cross-kv": dict(r=4, lora_alpha=16, target_modules=r".*encoder_attn\.(k_proj|v_proj)"),
        "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    },
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    hf = tiny_t5(gated=True, seed=7) if request.param == "t5" else tiny_bart(seed=7)
    ours, config = load_ours(hf, tmp_path_factory.mktemp(request.param))
    rng = random.Random(1)
    eos = hf.config.eos_token_id
    prompts = [[rng.randrange(4, 300) for _ in range(rng.randint(2, 40))] + [eos] for _ in range(4)]
    shapes = engine_for(ours, config, max_active_adapters=1).lora.base_shapes
    adapters = {}
    for seed, (name, kwargs) in enumerate(CASES[request.param].items()):
        model = peft_model(hf, seed=seed + 1, **kwargs)
        adapter = save_and_load(model, tmp_path_factory.mktemp(name), name, shapes)
        adapters[name] = (adapter, [hf_seq2seq_greedy(model, p, NEW) for p in prompts])
    base = [hf_seq2seq_greedy(hf, p, NEW) for p in prompts]
    return ours, config, prompts, adapters, base


@pytest.mark.parametrize("case", list(CASES["t5"]))
def test_lora_matches_peft(family, case):
    ours, config, prompts, adapters, base = family
    adapter, want = adapters[case]
    engine = engine_for(ours, config, max_active_adapters=2)
    got = [o.token_ids for o in engine.generate(prompts, PARAMS, adapters=[adapter] * len(prompts))]
    assert got == want
    assert got != base, f"{case} changes nothing: the test proves nothing"


def test_row_kinds():
    """Which rows each linear reads, from its family's declared `linear_rows`."""
    from loraplex.models.bart import BartForConditionalGeneration as Bart
    from loraplex.models.llava_next import LlavaNextForConditionalGeneration as Llava
    from loraplex.models.t5 import T5ForConditionalGeneration as T5

    t5, bart, llava = T5.linear_rows, Bart.linear_rows, Llava.linear_rows
    assert row_kind("encoder.block.1.layer.0.SelfAttention.q", t5) == "encoder"
    assert row_kind("encoder.block.0.layer.1.DenseReluDense.wo", t5) == "encoder"
    assert row_kind("decoder.block.0.layer.1.EncDecAttention.k", t5) == "states"
    assert row_kind("decoder.block.0.layer.1.EncDecAttention.q", t5) == "tokens"
    assert row_kind("decoder.block.2.layer.2.DenseReluDense.wi_0", t5) == "tokens"
    assert row_kind("model.encoder.layers.0.fc1", bart) == "encoder"
    assert row_kind("model.decoder.layers.1.encoder_attn.v_proj", bart) == "states"
    assert row_kind("model.decoder.layers.1.encoder_attn.out_proj", bart) == "tokens"
    assert row_kind("model.decoder.layers.1.self_attn.k_proj", bart) == "tokens"
    assert row_kind("model.vision_tower.encoder.layers.0.self_attn.k_proj", llava) == "patches"
    assert row_kind("lm_head", t5) == row_kind("lm_head") == "logits"
    assert row_kind("model.encoder.layers.0.fc1") == "tokens"  # no declaration: every linear reads the token rows


def test_wrapped_linears_take_their_familys_row_kinds(family):
    ours, config = family[:2]
    layers = engine_for(ours, config, max_active_adapters=1).lora.layers
    by_kind = {}
    for name, layer in layers.items():
        by_kind.setdefault(layer.row_kind, []).append(name)
    assert set(by_kind) == {"tokens", "encoder", "states", "logits"}, by_kind.keys()
    assert all(name.endswith(("EncDecAttention.k", "EncDecAttention.v", "encoder_attn.k_proj", "encoder_attn.v_proj"))
               for name in by_kind["states"])


def test_mixed_adapters_and_base(family):
    ours, config, prompts, adapters, base = family
    variants = [(None, base), *adapters.values()]
    jobs = [(p, a, want[i]) for i, p in enumerate(prompts) for a, want in variants]
    random.Random(2).shuffle(jobs)
    for threshold in (0, 10**6):  # the segmented form, then the stacked form for every decode step
        engine = engine_for(ours, config, max_active_adapters=len(variants))
        engine.runner.lora_planner.stacked_rows_per_segment = threshold
        outs = engine.generate([p for p, _, _ in jobs], PARAMS, adapters=[a for _, a, _ in jobs])
        assert [o.token_ids for o in outs] == [w for _, _, w in jobs], threshold
