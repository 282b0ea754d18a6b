"""The RoPE kinds that depend on a sequence's length (dynamic NTK, Phi-3's LongRoPE) and partial rotary, against
transformers: the rotary embedding itself past the threshold, greedy tokens as its generate picks them while a
sequence crosses the threshold in decode, and sequences on both sides of it in one engine batch, each as it runs
alone in transformers."""

import copy
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from loraplex.engine.loading import build_model
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.hf_config import rope_from_hf
from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, ours_from_hf, tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 16  # the threshold: dynamic's max_position_embeddings, LongRoPE's original_max_position_embeddings
HALF = 8  # rotary frequencies of tiny_hf_model's heads (head_dim 16)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
            "long_factor": [1.0 + 1.5 * i for i in range(HALF)]}
MODELS = {
    "llama-dynamic": ("llama", {"max_position_embeddings": CONTEXT,
                                "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
    "phi3-longrope": ("phi3", {"pad_token_id": 0, "max_position_embeddings": 4 * CONTEXT,
                               "original_max_position_embeddings": CONTEXT, "rope_parameters": LONGROPE}),
    # Phi-4-mini's recipe: LongRoPE over half of each head; its factors are one per rotary frequency.
    "phi3-longrope-partial": ("phi3", {"pad_token_id": 0, "max_position_embeddings": 4 * CONTEXT,
                                       "original_max_position_embeddings": CONTEXT, "partial_rotary_factor": 0.5,
                                       "rope_parameters": {**LONGROPE, "short_factor": LONGROPE["short_factor"][:4],
                                                           "long_factor": LONGROPE["long_factor"][:4]}}),
    "phi3-partial": ("phi3", {"pad_token_id": 0, "partial_rotary_factor": 0.5}),
}
NEW = 30
PROMPT = [5, 17, 42, 99, 3, 250, 7, 1]  # 8 tokens: 30 more cross the threshold at 16 during decode


SHARPEN = 3.0  # q and k scaled: see sharpened()


def sharpened(hf):
    """`hf` with its query and key projections scaled by SHARPEN. At random init attention is near uniform, so
    positions barely move the logits and greedy decoding falls into the same loop whatever the rotary does: a test
    of the scaling would prove nothing. Sharper attention makes the tokens depend on the angles."""
    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qk_rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * head_dim
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):  # Phi-3's fused projection: q's rows, then k's, then v's
                attn.qkv_proj.weight[:qk_rows] *= SHARPEN
            else:
                attn.q_proj.weight.mul_(SHARPEN)
                attn.k_proj.weight.mul_(SHARPEN)
    return hf


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    kind, overrides = MODELS[request.param]
    hf = sharpened(tiny_hf_model(kind, **copy.deepcopy(overrides)))
    ours, config = ours_from_hf(hf)
    return request.param, hf, ours, config


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy tokens for `prompt` run alone, its rotary's state as built (dynamic scaling keeps the
    longest length seen across calls)."""
    rotary = hf.model.rotary_emb
    rotary.inv_freq.copy_(rotary.original_inv_freq)
    rotary.max_seq_len_cached = rotary.original_max_seq_len
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def greedy(engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))]


# --- the rotary embedding against transformers' ---------------------------------------------------------------

HEAD_DIM = 32
LENGTHS = [5, 16, 17, 40, 120]  # sequences up to, at and past the threshold, all rows in one call


def rotary_configs() -> dict[str, tuple[type, type, dict]]:
    common = {"hidden_size": 4 * HEAD_DIM, "num_attention_heads": 4, "max_position_embeddings": CONTEXT}
    longrope = {**common, "max_position_embeddings": 4 * CONTEXT, "original_max_position_embeddings": CONTEXT,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0 + 0.02 * i for i in range(HEAD_DIM // 2)],
                                    "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]}}
    quarter = HEAD_DIM // 8  # frequencies of a quarter-width rotary
    return {
        "dynamic": (LlamaRotaryEmbedding, LlamaConfig,
                    {**common, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
        "longrope": (Phi3RotaryEmbedding, Phi3Config, longrope),
        "longrope-stated-attention-factor": (Phi3RotaryEmbedding, Phi3Config, {
            **longrope, "rope_parameters": {**longrope["rope_parameters"], "attention_factor": 0.8}}),
        "longrope-partial": (Phi3RotaryEmbedding, Phi3Config, {
            **longrope, "partial_rotary_factor": 0.25,
            "rope_parameters": {**longrope["rope_parameters"], "short_factor": [1.0] * quarter,
                                "long_factor": [2.0 + i for i in range(quarter)]}}),
        "partial-in-rope-parameters": (Phi3RotaryEmbedding, Phi3Config, {
            **common, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    }


@pytest.mark.parametrize("name", sorted(rotary_configs()))
def test_cos_and_sin_match_transformers_per_row_on_both_sides_of_the_threshold(name):
    reference_cls, config_cls, hf = rotary_configs()[name]
    ours = RotaryEmbedding(rope_from_hf(copy.deepcopy(hf)), HEAD_DIM)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    seq_lens = torch.cat([torch.full((n,), n) for n in LENGTHS])
    cos, sin = ours(positions, torch.float32, seq_lens)
    for n, got_cos, got_sin in zip(LENGTHS, cos.split(LENGTHS), sin.split(LENGTHS)):
        reference = reference_cls(config_cls(**copy.deepcopy(hf)))  # fresh: transformers' dynamic state
        expected_cos, expected_sin = reference(torch.zeros(1, n, HEAD_DIM), torch.arange(n)[None])
        # Angles up to 120 rad: float32 products a few ulps apart between a matmul and a multiplication.
        torch.testing.assert_close(got_cos[:, 0], expected_cos[0], atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(got_sin[:, 0], expected_sin[0], atol=5e-5, rtol=1e-5)
    # The rows of the longest sequence are really scaled: those of a short one differ at the same positions.
    short = ours(positions[-LENGTHS[-1]:], torch.float32, torch.full((LENGTHS[-1],), 1))[0]
    if "partial-in" not in name:
        assert (short - cos[-LENGTHS[-1]:]).abs().max() > 0.05


def test_longrope_attention_factor_and_phi3_names():
    rope = rope_from_hf({**rotary_configs()["longrope"][2], "model_type": "phi3"})
    assert rope.kind == "longrope" and rope.original_max_position_embeddings == CONTEXT
    assert rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(16.0))).sqrt().item())
    old = copy.deepcopy(rotary_configs()["longrope"][2])
    old["rope_parameters"]["rope_type"] = "su"  # Phi-3's first name for it, read as longrope by Phi3Config
    assert rope_from_hf({**old, "model_type": "phi3"}) == rope


@pytest.mark.parametrize("field,value,match", [
    ("long_factor", [1.0] * 3, "long_factor"), ("short_factor", None, "short_factor"),
    ("short_factor", [1.0] * (HEAD_DIM // 2 - 1) + [0.0], "short_factor"),
    ("partial_rotary_factor", 1.5, "partial_rotary_factor 1.5"), ("factor", None, "factor"),
    ("factor", 0.5, "factor 0.5: dynamic scaling needs a factor of at least 1"),
])
def test_unservable_values_are_refused_by_name(field, value, match):
    kind = "dynamic" if field == "factor" else "longrope"
    hf = copy.deepcopy(rotary_configs()[kind][2])
    hf["rope_parameters"][field] = value
    with pytest.raises(ValueError, match=match):
        rope_from_hf(hf)


# --- models: token by token against transformers, and mixed batches ---------------------------------------------

def test_logits_of_a_prompt_past_the_threshold_match_transformers(pair):
    _, hf, ours, config = pair
    prompt = PROMPT * 3  # 24 tokens: past the threshold from the prompt on
    expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(full_logits(ours, config, prompt), expected, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers_across_the_threshold_and_the_scaling_matters(pair):
    name, hf, ours, config = pair
    expected = hf_greedy(hf, PROMPT, NEW)
    assert greedy(engine_for(ours, config), [PROMPT], NEW)[0] == expected
    # Without its scaling (plain RoPE over whole heads) the same weights pick other tokens.
    plain = replace(config, rope=replace(config.rope, kind="default", partial_rotary_factor=1.0, attention_factor=1.0))
    unscaled = build_model(plain, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    got = greedy(engine_for(unscaled, plain), [PROMPT], NEW)[0]
    assert got != expected, name
    if name == "llama-dynamic":
        # Dynamic NTK is plain RoPE up to the threshold: the same tokens until a sequence passes it (token i comes
        # from a sequence of len(PROMPT) + i), other tokens after.
        within = CONTEXT - len(PROMPT) + 1
        assert got[:within] == expected[:within] and got[within:] != expected[within:]


def test_sequences_on_both_sides_of_the_threshold_in_one_batch_equal_their_solo_runs(pair):
    """One engine batch: a prompt past the threshold already, one that crosses it in decode, one that never does
    (its last length is 14); the long prompt arrives while the others decode, so one step mixes its prefill rows
    with their decode rows."""
    _, hf, ours, config = pair
    prompts, new = [PROMPT * 3, PROMPT, PROMPT[:2]], 12
    expected = [hf_greedy(hf, p, new) for p in prompts]
    engine = engine_for(ours, config)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts[1:]]
    finals = {}
    for step in range(64):
        if step == 2:
            requests.insert(0, engine.add_request(prompts[0], params))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        if not engine.has_unfinished:
            break
    assert [finals[r.request_id] for r in requests] == expected


def test_a_chunked_prefill_rotates_every_chunk_as_the_whole_prompt(pair):
    """A 24-token prompt prefilled 8 tokens a step: its first chunks end within the threshold, yet transformers
    encodes the whole prompt past it; every chunk takes the prompt's length (AttentionMetadata.rope_lens)."""
    _, hf, ours, config = pair
    prompt = PROMPT * 3
    engine = engine_for(ours, config, max_batch_prefill_tokens=8)
    assert greedy(engine, [prompt], 6)[0] == hf_greedy(hf, prompt, 6)


def test_prefix_caching_is_off_where_rotation_depends_on_length(pair):
    name, _, ours, config = pair
    engine = engine_for(ours, config, prefix_caching=True)
    assert engine.config.prefix_caching == (name == "phi3-partial")  # partial rotary alone depends on no length
