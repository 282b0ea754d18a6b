"""What every family's config normaliser shares: the config.json field checks run before any family reads a
field (`HF_FIELDS`), the refusal of a value we cannot serve (`require`), token ids, rope scaling, and the
wrapper that turns a missing field into a ValueError (`normalised`)."""

from __future__ import annotations

import math
import reprlib
from typing import Any, Callable

from loraplex.layers.rotary import RopeConfig
from loraplex.models.config import ModelConfig


def normalised(normalise: Callable[[dict[str, Any]], ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """`normalise(hf)`, its fields checked first. Raises ValueError naming what the config lacks, holds wrongly
    typed, or what we do not serve."""
    check_hf_fields(hf)
    try:
        return normalise(hf)
    except KeyError as exc:  # a field every config of its family has
        raise ValueError(f"its config.json lacks {exc.args[0]!r}") from exc


def token_id(field: str, value: Any, vocab_size: int) -> int | None:
    """A config's optional token id (None stays None), checked against the vocabulary."""
    if value is not None:
        require(field, value, isinstance(value, int) and 0 <= value < vocab_size, "not a token id")
    return value


def token_ids(field: str, value: Any, vocab_size: int) -> tuple[int, ...]:
    """A config's token id or list of them, as a tuple (None: empty)."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(token_id(field, v, vocab_size) for v in values)


def require(field: str, value: Any, ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(f"unsupported {field} {value!r}: {why}")


# config.json fields the families read, checked before anything is built from them, wherever they appear (the top
# level or a nested config below): a wrong type or an absurd size is refused naming the field, never met later as a
# TypeError, a ZeroDivisionError or a giant allocation. name -> (kind, smallest, largest); "ints": one or a list.
# The bounds are far beyond any real model.
_DIM, _COUNT, _POSITIONS, _TOKEN = (1, 1 << 20), (1, 1 << 12), (1, 1 << 31), (0, 1 << 31)
_FACTOR = (1e-3, 10**6)
HF_FIELDS: dict[str, tuple[str, float, float]] = {
    "vocab_size": ("int", 1, 1 << 24),
    **dict.fromkeys(("hidden_size", "intermediate_size", "head_dim", "d_model", "d_ff", "d_kv", "decoder_ffn_dim",
                     "encoder_ffn_dim", "ffn_hidden_size", "vision_output_dim"), ("int", *_DIM)),
    **dict.fromkeys(("num_hidden_layers", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                     "decoder_layers", "num_global_layers", "num_attention_heads", "num_key_value_heads", "n_heads",
                     "num_heads", "kv_n_heads", "encoder_attention_heads", "decoder_attention_heads", "attention_heads",
                     "relative_attention_num_buckets", "max_num_tiles"), ("int", *_COUNT)),
    **dict.fromkeys(("max_position_embeddings", "max_seq_len", "original_max_position_embeddings",
                     "relative_attention_max_distance"), ("int", *_POSITIONS)),
    "image_size": ("ints", 1, 1 << 14), "patch_size": ("int", 1, 1 << 14), "num_channels": ("int", 1, 64),
    **dict.fromkeys(("bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_bos_token_id",
                     "forced_eos_token_id", "image_token_id", "image_token_index"), ("ints", *_TOKEN)),
    "sliding_window": ("int", *_TOKEN), "max_window_layers": ("int", 0, 1 << 12),  # 0 in some configs that turn it off (use_sliding_window false)
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"), ("num", 0, 1)),
    # Mixture-of-experts (Mixtral, Qwen2-MoE); output_router_logits (a training output) is not read. The router's
    # jitter noise is a training-time perturbation (transformers applies it only in training): checked, not applied.
    **dict.fromkeys(("num_local_experts", "num_experts"), ("int", 0, 1 << 12)),  # 0 experts: every layer dense
    **dict.fromkeys(("num_experts_per_tok", "decoder_sparse_step"), ("int", *_COUNT)),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), ("int", *_DIM)),
    "mlp_only_layers": ("ints", 0, 1 << 12), "router_jitter_noise": ("num", 0, 1),
    "rope_theta": ("num", 1, 10**12), "alibi_bias_max": ("num", 0, 1000), "expansion_ratio": ("num", *_FACTOR),
    **dict.fromkeys(("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"), ("num", *_FACTOR)),
    **dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim"), ("num", *_FACTOR)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "qkv_bias", "mlp_bias", "use_sliding_window", "no_bias",
                     "norm_topk_prob", "output_router_logits",
                     "scale_embedding", "qk_ln", "alibi", "multimodal_projector_bias", "scale_decoder_outputs", "truncate"),
                    ("bool", 0, 0)),
    **dict.fromkeys(("model_type", "hidden_act", "hidden_activation", "activation_function", "feed_forward_proj", "norm_type",
                     "projector_hidden_act", "rope_type", "type"), ("str", 0, 0)),
    **dict.fromkeys(("text_config", "vision_config", "attn_config", "ffn_config", "rope_scaling", "rope_parameters"),
                    ("object", 0, 0)),
}
# Fields the families read as "absent" when null (`x or default`, `x is None`); any other may not be null.
HF_NULLABLE = frozenset({
    "num_key_value_heads", "head_dim", "sliding_window", "num_decoder_layers", "kv_n_heads", "ffn_hidden_size",
    "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_bos_token_id",
    "forced_eos_token_id", "image_token_id", "image_token_index", "text_config", "vision_config", "attn_config",
    "ffn_config", "rope_scaling", "rope_parameters", "factor", "attention_factor", "mscale", "mscale_all_dim",
    "mlp_only_layers",
    "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
})
_NESTED = ("text_config", "vision_config", "attn_config", "ffn_config", "rope_scaling", "rope_parameters")
_KINDS = {"int": "an integer", "ints": "an integer or a list of integers", "num": "a number", "bool": "true or false",
          "str": "a string", "object": "an object"}


def check_hf_fields(hf: Any, where: str = "", depth: int = 0) -> None:
    """Refuse a config.json (a dict from JSON) whose known fields have the wrong type or an absurd value (HF_FIELDS),
    with a one-line ValueError naming the field."""
    if not isinstance(hf, dict):
        raise ValueError(f"config.json: {where.rstrip('.') or 'the config'} must be an object; got {reprlib.repr(hf)}")
    for name, (kind, lo, hi) in HF_FIELDS.items():
        if name not in hf or (hf[name] is None and name in HF_NULLABLE):
            continue
        value = hf[name]
        if not _field_ok(kind, value, lo, hi):
            bounds = f" in [{lo}, {hi}]" if kind in ("int", "ints", "num") else ""
            raise ValueError(f"config.json: {where}{name} must be {_KINDS[kind]}{bounds}; got {reprlib.repr(value)}")
    for name in _NESTED if depth < 2 else ():
        if isinstance(hf.get(name), dict):
            check_hf_fields(hf[name], f"{where}{name}.", depth + 1)


def _field_ok(kind: str, value: Any, lo: float, hi: float) -> bool:
    def number(x: Any, integer: bool) -> bool:
        if isinstance(x, bool) or not isinstance(x, int if integer else (int, float)):
            return False
        return lo <= x <= hi  # false for NaN

    if kind == "ints":
        return all(number(x, True) for x in value) if isinstance(value, list) else number(value, True)
    if kind in ("int", "num"):
        return number(value, kind == "int")
    return isinstance(value, {"bool": bool, "str": str, "object": dict}[kind])


ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older versions `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    phi3 = hf.get("model_type") == "phi3"
    if phi3 and kind in ("su", "yarn"):  # Phi3Config reads its older names as longrope
        kind = "longrope"
    if kind not in ROPE_KINDS:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_KINDS)}")
    low, high = merged.get("low_freq_factor", 1.0), merged.get("high_freq_factor", 4.0)
    require("rope_scaling.high_freq_factor", high, kind != "llama3" or high > low, f"must exceed low_freq_factor {low}")
    # As transformers: the pretraining context is the model's own unless the scaling names it (a top-level field
    # first, as Phi-3 writes it, which Phi3Config defaults to 4096), and YaRN's and LongRoPE's factor defaults to the
    # ratio of the two. Dynamic NTK scaling starts past the model's own context whatever the config names.
    max_positions = hf.get("max_position_embeddings", 8192)
    original = (hf.get("original_max_position_embeddings") or (4096 if phi3 else None)
                or merged.get("original_max_position_embeddings") or max_positions)
    if kind == "dynamic":
        original = max_positions
    factor = merged.get("factor")
    # Dynamic NTK extends the context by its factor (rope_context): below 1 it would shrink it under the model's own.
    require("rope_scaling.factor", factor, kind != "dynamic" or (factor is not None and factor >= 1),
            "dynamic scaling needs a factor of at least 1")
    if factor is None:
        factor = max_positions / original if kind in ("yarn", "longrope") else 1.0
    beta_fast, beta_slow = merged.get("beta_fast") or 32.0, merged.get("beta_slow") or 1.0
    require("rope_scaling.beta_fast", beta_fast, beta_fast > beta_slow, f"must exceed beta_slow {beta_slow}")
    partial = _partial_rotary_factor(hf, merged)
    frequencies = -(-int(_head_dim(hf) * partial) // 2) if kind == "longrope" else 0  # one per pair of rotary dims
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(factor),
        low_freq_factor=float(low),
        high_freq_factor=float(high),
        original_max_position_embeddings=int(original),
        beta_fast=float(beta_fast),
        beta_slow=float(beta_slow),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=_attention_factor(kind, merged, float(factor), int(original)),
        short_factor=_frequency_factors(merged, "short_factor", frequencies) if kind == "longrope" else (),
        long_factor=_frequency_factors(merged, "long_factor", frequencies) if kind == "longrope" else (),
        partial_rotary_factor=partial,
    )


def rope_context(hf: dict[str, Any], max_positions: int) -> int:
    """The longest sequence a model serves: its max_position_embeddings, `factor` times that under dynamic NTK
    scaling, which exists to run past it (vLLM derives its context so)."""
    rope = rope_from_hf(hf)
    return int(max_positions * rope.factor) if rope.kind == "dynamic" else max_positions


def _head_dim(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _partial_rotary_factor(hf: dict[str, Any], scaling: dict[str, Any]) -> float:
    """The share of each head that rotates: the rope parameters' value first, then the top level's (transformers'
    order)."""
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is None:
        return 1.0
    ok = isinstance(partial, (int, float)) and not isinstance(partial, bool) and 0 < partial <= 1
    require("partial_rotary_factor", partial, ok and int(_head_dim(hf) * partial) >= 2,
            "must be in (0, 1] and leave at least two rotary dims per head")
    return float(partial)


def _frequency_factors(scaling: dict[str, Any], name: str, length: int) -> tuple[float, ...]:
    """LongRoPE's short_factor or long_factor: one positive number per rotary frequency."""
    value = scaling.get(name)
    numbers = isinstance(value, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in value)
    if not (numbers and len(value) == length):
        raise ValueError(f"unsupported rope_scaling.{name} {reprlib.repr(value)}: longrope needs a list of {length} "
                         "positive numbers (one per pair of rotary dims)")
    return tuple(float(x) for x in value)


def _attention_factor(kind: str, scaling: dict[str, Any], factor: float, original: int) -> float:
    """What cos and sin are scaled by: YaRN's (below) or LongRoPE's sqrt(1 + ln(factor) / ln(original)), unless the
    config states it; 1.0 for every other kind."""
    if kind == "yarn":
        return _yarn_attention_factor(scaling, factor)
    if kind != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    require("original_max_position_embeddings", original, original > 1, "longrope needs a context of two or more")
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """The paper's 0.1 ln(s) + 1 (its eq. 21), or DeepSeek's ratio of two such terms, unless the config states it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)
