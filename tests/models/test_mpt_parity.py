"""MPT (MosaicML) parity.

- Against transformers' MptForCausalLM (ALiBi, 4 and 6 heads: power-of-two and not, clip_qkv, softmax_scale,
  tied and untied embeddings), loaded the way a user's checkpoint is (save_pretrained -> resolve_model ->
  config_from_hf -> load_state_dict -> build_model): logits through our paged prefill, greedy tokens
  through the engine (decode groups, chunked prefill over cached context, mixed batches, preemption).
- Variants transformers does not implement (multi-query and grouped-query attention, qk_ln, RMSNorm, biases,
  logit_scale, alibi_bias_max, expansion_ratio, no positions) from MosaicML-form checkpoints written here,
  against a short dense reference written from the published formulas (full attention, an explicit ALiBi
  matrix, no paging); each flag is shown to change the output, so it is read.
- Configurations we cannot serve exactly are refused, naming the field.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.engine.loading import build_model
from loraplex.layers.alibi import alibi_slopes
from loraplex.models.registry import config_from_hf
from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits

VOCAB = 128
NEW = 12
PROMPTS = [[5, 17, 42, 99, 3, 120, 7, 1, 64, 100, 11, 12, 13, 14, 15, 16, 20, 21, 22, 9, 8, 7], [3, 1, 4, 1, 5], [77]]


def load_ours(path):
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    return build_model(config, load_state_dict(source)), config


def greedy(engine, prompts, new=NEW):
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))]


# ------------------------------------------------------------------------------------------------
# Against transformers

HF_VARIANTS = {
    "h4": dict(d_model=64, n_heads=4),
    "h6-clip": dict(d_model=48, n_heads=6, attn_config={"clip_qkv": 0.25}),
    "h6-scale-untied": dict(d_model=48, n_heads=6, attn_config={"softmax_scale": 0.5}, tie_word_embeddings=False),
}


def tiny_hf_mpt(seed=0, attn_config=None, **kw):
    import transformers

    config = transformers.MptConfig(
        n_layers=2, max_seq_len=256, vocab_size=VOCAB, attn_config={"alibi": True, **(attn_config or {})}, **kw
    )
    torch.manual_seed(seed)
    model = transformers.MptForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, and attention sharp enough that positions (ALiBi) matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "Wqkv" in name:
                p.mul_(5)
    return model


@pytest.fixture(scope="module", params=sorted(HF_VARIANTS))
def hf_pair(request, tmp_path_factory):
    hf = tiny_hf_mpt(**copy.deepcopy(HF_VARIANTS[request.param]))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, config = load_ours(path)
    return hf, ours, config


@torch.inference_mode()
def hf_greedy(hf, prompt, new=NEW):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_alibi_slopes_are_mosaicmls():
    # Powers of two: 2^-(8(h+1)/n). Six heads: the eight-head list, odd-indexed first, then even-indexed.
    assert alibi_slopes(4).tolist() == [2**-2, 2**-4, 2**-6, 2**-8]
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    assert alibi_slopes(4, 16).tolist() == [2**-4, 2**-8, 2**-12, 2**-16]
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in (3, 4, 6, 12):  # transformers' bias at key 0 of a 9-key window is -8 * slope
        torch.testing.assert_close(alibi_slopes(heads), -build_mpt_alibi_tensor(heads, 9)[:, 0, 0] / 8)


@torch.inference_mode()
def test_logits_match_transformers(hf_pair):
    hf, ours, config = hf_pair
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    for prompt in PROMPTS:
        expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(full_logits(ours, config, prompt), expected, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(hf_pair):
    hf, ours, config = hf_pair
    # 22 + 12 tokens crosses a 16-token KV block; the three prompts decode in one batch.
    assert greedy(engine_for(ours, config), PROMPTS) == [hf_greedy(hf, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def h6(tmp_path_factory):
    hf = tiny_hf_mpt(seed=3, **copy.deepcopy(HF_VARIANTS["h6-clip"]))
    path = tmp_path_factory.mktemp("h6")
    hf.save_pretrained(path)
    return hf, *load_ours(path)


def test_chunked_prefill_and_mixed_batch_match_transformers(h6):
    hf, ours, config = h6
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (90, 7, 33, 1, 50)]
    expected = [hf_greedy(hf, p) for p in prompts]
    alone = [greedy(engine_for(ours, config), [p])[0] for p in prompts]
    assert alone == expected
    # Prefill in chunks of 16 tokens: later chunks attend to cached context (ALiBi from absolute positions).
    assert greedy(engine_for(ours, config, max_batch_prefill_tokens=16), prompts) == expected
    assert greedy(engine_for(ours, config), prompts) == expected


def test_preemption_changes_nothing(h6):
    hf, ours, config = h6
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (20,), generator=gen).tolist() for _ in range(5)]
    engine = engine_for(ours, config, max_batch_total_tokens=96, block_size=16)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    assert sum(r.num_preemptions for r in requests) > 0, "the cache was meant to be too small"
    assert [finals[r.request_id] for r in requests] == [hf_greedy(hf, p, 30) for p in prompts]


# ------------------------------------------------------------------------------------------------
# MosaicML-form checkpoints against a dense reference


def mosaic_config(**kw):
    attn = {"attn_type": "multihead_attention", "alibi": True, "alibi_bias_max": 8, "clip_qkv": None,
            "qk_ln": False, "softmax_scale": None, "prefix_lm": False, "attn_uses_sequence_id": False,
            **kw.pop("attn_config", {})}
    return {"model_type": "mpt", "architectures": ["MPTForCausalLM"], "d_model": 48, "n_heads": 6, "n_layers": 2,
            "expansion_ratio": 2, "max_seq_len": 256, "vocab_size": VOCAB, "no_bias": True,
            "norm_type": "low_precision_layernorm", "learned_pos_emb": True, "logit_scale": None,
            "layer_norm_epsilon": 1e-5, "attn_config": attn, "ffn_config": {"ffn_type": "mptmlp"}, **kw}


def kv_heads_of(cfg):
    attn = cfg["attn_config"]
    return {"multihead_attention": cfg["n_heads"], "multiquery_attention": 1}.get(attn["attn_type"], attn.get("kv_n_heads"))


def random_state(cfg, seed=0):
    """Random MosaicML-named tensors for `cfg` (shapes from the published MPT block)."""
    gen = torch.Generator().manual_seed(seed)
    d, heads = cfg["d_model"], cfg["n_heads"]
    hd, kv = d // heads, kv_heads_of(cfg)
    inner = d * cfg["expansion_ratio"]
    bias, rms = not cfg["no_bias"], "rmsnorm" in cfg["norm_type"]
    state = {}

    def rand(shape, scale):
        return torch.randn(shape, generator=gen) * scale

    def linear(name, out, inp, scale):
        state[f"{name}.weight"] = rand((out, inp), scale)
        if bias:
            state[f"{name}.bias"] = rand((out,), 0.1)

    def norm(name, size):
        state[f"{name}.weight"] = 1 + rand((size,), 0.1)
        if bias and not rms:
            state[f"{name}.bias"] = rand((size,), 0.1)

    state["transformer.wte.weight"] = rand((VOCAB, d), 0.5)
    for i in range(cfg["n_layers"]):
        p = f"transformer.blocks.{i}"
        norm(f"{p}.norm_1", d)
        linear(f"{p}.attn.Wqkv", d + 2 * kv * hd, d, 0.4)
        if cfg["attn_config"]["qk_ln"]:
            norm(f"{p}.attn.q_ln", d)
            norm(f"{p}.attn.k_ln", kv * hd)
        linear(f"{p}.attn.out_proj", d, d, 0.1)
        norm(f"{p}.norm_2", d)
        linear(f"{p}.ffn.up_proj", inner, d, 0.15)
        linear(f"{p}.ffn.down_proj", d, inner, 0.1)
    norm("transformer.norm_f", d)
    if not cfg.get("tie_word_embeddings", True):
        state["lm_head.weight"] = rand((VOCAB, d), 0.5)
    return state


def reference_slopes(heads, bias_max):
    padded = 2 ** math.ceil(math.log2(heads))
    slopes = [2 ** (-bias_max * (i + 1) / padded) for i in range(padded)]
    return torch.tensor((slopes[1::2] + slopes[::2])[:heads] if padded != heads else slopes)


@torch.inference_mode()
def dense_reference(cfg, state, tokens):
    """MPT's forward pass written from the published formulas: logits [T, vocab]."""
    attn = cfg["attn_config"]
    d, heads, kv = cfg["d_model"], cfg["n_heads"], kv_heads_of(cfg)
    hd, eps, T = d // heads, cfg["layer_norm_epsilon"], len(tokens)
    rms = "rmsnorm" in cfg["norm_type"]

    def norm(x, name):
        w = state[f"{name}.weight"]
        if rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        return F.layer_norm(x, (x.shape[-1],), w, None if cfg["no_bias"] else state[f"{name}.bias"], eps)

    def linear(x, name):
        y = x @ state[f"{name}.weight"].T
        return y if cfg["no_bias"] else y + state[f"{name}.bias"]

    # MosaicML's causal ALiBi: slope * (key - last key), a constant shift per row away from slope * (key - query).
    keys = torch.arange(T)
    bias = torch.zeros(heads, T, T)
    if attn["alibi"]:
        bias = reference_slopes(heads, attn["alibi_bias_max"])[:, None, None] * (keys - (T - 1)).float()[None, None, :]
    bias = bias.masked_fill(keys[None, :] > keys[:, None], float("-inf"))
    scale = attn["softmax_scale"] or 1 / math.sqrt(hd)

    x = state["transformer.wte.weight"][torch.tensor(tokens)]
    for i in range(cfg["n_layers"]):
        p = f"transformer.blocks.{i}"
        qkv = linear(norm(x, f"{p}.norm_1"), f"{p}.attn.Wqkv")
        if attn["clip_qkv"]:
            qkv = qkv.clamp(-attn["clip_qkv"], attn["clip_qkv"])
        q, k, v = qkv.split([d, kv * hd, kv * hd], dim=-1)
        if attn["qk_ln"]:
            q, k = norm(q, f"{p}.attn.q_ln"), norm(k, f"{p}.attn.k_ln")
        q = q.view(T, heads, hd).transpose(0, 1)
        k = k.view(T, kv, hd).transpose(0, 1).repeat_interleave(heads // kv, dim=0)
        v = v.view(T, kv, hd).transpose(0, 1).repeat_interleave(heads // kv, dim=0)
        weights = torch.softmax(q @ k.transpose(1, 2) * scale + bias, dim=-1)
        x = x + linear((weights @ v).transpose(0, 1).reshape(T, d), f"{p}.attn.out_proj")
        x = x + linear(F.gelu(linear(norm(x, f"{p}.norm_2"), f"{p}.ffn.up_proj")), f"{p}.ffn.down_proj")
    x = norm(x, "transformer.norm_f")
    logits = x @ state.get("lm_head.weight", state["transformer.wte.weight"]).T
    scale = cfg["logit_scale"]
    if scale == "inv_sqrt_d_model":
        scale = 1 / math.sqrt(d)
    return logits if scale is None else logits * scale


def reference_greedy(cfg, state, prompt, new=NEW):
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(dense_reference(cfg, state, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def write_checkpoint(path, cfg, state):
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))


def with_attn(**attn):
    return lambda cfg: {**cfg, "attn_config": {**cfg["attn_config"], **attn}}


# name -> (config overrides, the same checkpoint read with the flag off (None: shapes change with it))
MOSAIC_VARIANTS = {
    "base-mha": ({}, None),
    "multiquery": ({"attn_config": {"attn_type": "multiquery_attention"}}, None),
    "grouped-query": ({"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}}, None),
    "qk-ln": ({"attn_config": {"qk_ln": True}}, with_attn(qk_ln=False)),
    "rmsnorm": ({"norm_type": "rmsnorm"}, lambda c: {**c, "norm_type": "layernorm"}),
    "biases": ({"no_bias": False}, None),
    "logit-scale": ({"logit_scale": 0.5}, lambda c: {**c, "logit_scale": None}),
    "logit-scale-inv-sqrt": ({"logit_scale": "inv_sqrt_d_model"}, lambda c: {**c, "logit_scale": None}),
    "alibi-bias-max-4": ({"attn_config": {"alibi_bias_max": 4}}, with_attn(alibi_bias_max=8)),
    "clip-qkv": ({"attn_config": {"clip_qkv": 0.5}}, with_attn(clip_qkv=None)),
    "softmax-scale": ({"attn_config": {"softmax_scale": 0.2}}, with_attn(softmax_scale=None)),
    "no-positions": ({"learned_pos_emb": False, "attn_config": {"alibi": False}}, with_attn(alibi=True)),
    "untied-h4-expansion3": ({"n_heads": 4, "expansion_ratio": 3, "tie_word_embeddings": False}, None),
}


@pytest.mark.parametrize("name", sorted(MOSAIC_VARIANTS))
def test_mosaic_variants_match_dense_reference(name, tmp_path):
    overrides, flag_off = MOSAIC_VARIANTS[name]
    overrides = copy.deepcopy(overrides)
    cfg = mosaic_config(**{k: v for k, v in overrides.items() if k != "attn_config"},
                        attn_config=overrides.get("attn_config", {}))
    state = random_state(cfg, seed=len(name))
    write_checkpoint(tmp_path, cfg, state)
    ours, config = load_ours(tmp_path)
    assert config.num_kv_heads == kv_heads_of(cfg)  # the engine sizes its KV cache from these
    assert config.head_dim == cfg["d_model"] // cfg["n_heads"]
    prompt = PROMPTS[0]
    expected = dense_reference(cfg, state, prompt)
    torch.testing.assert_close(full_logits(ours, config, prompt), expected, atol=2e-4, rtol=1e-4)
    if flag_off is not None:  # ours equals the reference with the flag, which differs from it without
        assert not torch.allclose(dense_reference(flag_off(cfg), state, prompt), expected, atol=1e-3)
    prompts = [prompt, PROMPTS[1]]
    assert greedy(engine_for(ours, config, max_batch_prefill_tokens=8), prompts) == [
        reference_greedy(cfg, state, p) for p in prompts
    ]


@torch.inference_mode()
def test_dense_reference_matches_transformers(h6):
    """The reference itself agrees with transformers where transformers implements MPT."""
    hf, _, _ = h6
    cfg = mosaic_config(d_model=48, n_heads=6, expansion_ratio=4, attn_config={"clip_qkv": 0.25})
    state = {k: v.float() for k, v in hf.state_dict().items()}
    torch.testing.assert_close(dense_reference(cfg, state, PROMPTS[0]), hf(torch.tensor([PROMPTS[0]])).logits[0],
                               atol=2e-4, rtol=1e-4)


def test_transformers_config_dict_and_defaults():
    import transformers

    config = config_from_hf(transformers.MptConfig(d_model=64, n_heads=4, n_layers=3, vocab_size=VOCAB).to_dict())
    assert (config.model_type, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == ("mpt", 3, 4, 4, 16)
    assert config.tie_word_embeddings and config.mpt.alibi and config.mpt.no_bias and config.mpt.norm_type == "layernorm"
    assert config.mpt.softmax_scale == pytest.approx(0.25) and config.intermediate_size == 256
    # A MosaicML config.json that omits attn_config keys, ffn_config and tie_word_embeddings.
    bare = {"model_type": "mpt", "d_model": 64, "n_heads": 8, "n_layers": 2, "vocab_size": VOCAB,
            "expansion_ratio": 2, "attn_config": {"alibi": True, "attn_type": "multiquery_attention"}}
    config = config_from_hf(bare)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size, config.max_position_embeddings) == (1, 8, 128, 2048)


# ------------------------------------------------------------------------------------------------
# Refusals

REFUSED = {
    "learned_pos_emb": {"learned_pos_emb": True, "attn_config": {"alibi": False}},
    "prefix_lm": {"attn_config": {"prefix_lm": True}},
    "attn_uses_sequence_id": {"attn_config": {"attn_uses_sequence_id": True}},
    "ffn_type": {"ffn_config": {"ffn_type": "mb_moe"}},
    "ffn_act_fn": {"ffn_config": {"ffn_type": "mptmlp", "ffn_act_fn": {"name": "relu"}}},
    "attn_type": {"attn_config": {"attn_type": "sparse_attention"}},
    "kv_n_heads": {"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 4}},
    "rope": {"attn_config": {"rope": True}},
    "sliding_window_size": {"attn_config": {"sliding_window_size": 64}},
    "norm_type": {"norm_type": "triton_groupnorm"},
    "logit_scale": {"logit_scale": "inv_sqrt_vocab"},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_fields_are_refused_by_name(field):
    overrides = copy.deepcopy(REFUSED[field])
    cfg = mosaic_config(**{k: v for k, v in overrides.items() if k != "attn_config"},
                        attn_config=overrides.get("attn_config", {}))
    with pytest.raises(ValueError, match=field):
        config_from_hf(cfg)
