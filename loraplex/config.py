"""Configuration: the normalised model config and the engine's settings.

`ModelConfig.from_hf` is where Hugging Face config quirks stop: every family's config.json (old and new
transformers spellings alike) becomes one flat, frozen description that our model code reads.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from loraplex.multimodal.config import MediaConfig

if TYPE_CHECKING:
    from loraplex.models.mllama_vision import MllamaVisionSettings

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
T5_FAMILY = ("t5", "mt5")
BART_FAMILY = ("bart", "mbart")
# Activations our CLIP tower and LLaVA projector implement (models/clip.py holds the functions).
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-NeXT image path: the CLIP vision tower, which of its layers feed the projector, and how
    each image's tiles become its placeholder tokens (any-resolution grid, `image_newline`)."""

    # CLIP vision transformer
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # side of one square tile, in pixels
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    num_channels: int
    # LLaVA-NeXT
    vision_feature_layer: int | tuple[int, ...]  # hidden-state index (0: embeddings); several: concatenated
    vision_feature_select_strategy: str  # "default": drop the CLS token
    image_grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) resolutions an image may be tiled to
    image_token_id: int
    projector_hidden_act: str
    multimodal_projector_bias: bool = True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        layer = self.vision_feature_layer
        return (layer,) if isinstance(layer, int) else layer


@dataclass(frozen=True)
class MptConfig:
    """What MPT (MosaicML) needs beyond the shared fields: ALiBi, qkv clipping, q/k LayerNorm, norm kind,
    biases and logit scaling. Read from either transformers' MptConfig dict or MosaicML's own config.json."""

    alibi: bool = True  # False (with learned_pos_emb False): no position information at all
    alibi_bias_max: float = 8.0
    clip_qkv: float | None = None
    qk_ln: bool = False
    softmax_scale: float = 1.0  # resolved: attn_config.softmax_scale or 1/sqrt(head_dim)
    no_bias: bool = True  # True: no bias in any linear or norm
    norm_type: str = "layernorm"  # layernorm | rmsnorm (low-precision variants computed as these)
    norm_eps: float = 1e-5
    logit_scale: float | None = None  # resolved: "inv_sqrt_d_model" -> 1/sqrt(d_model)


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """What an encoder-decoder family (T5, BART) adds: its encoder's depth and how decoding starts and
    ends. `forced_bos_token_id` / `forced_eos_token_id` (from the generation config, else config.json)
    force the first token, and the token at the last step `max_new_tokens` allows, as transformers does."""

    num_encoder_layers: int
    decoder_start_token_id: int
    max_source_positions: int | None = None  # BART's learned positions bound the encoder input; T5 has none
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: tuple[int, ...] = ()  # a config's forced_eos_token_id: one id or a list


@dataclass(frozen=True)
class T5Settings:
    """T5's own settings: the feed-forward kind, relative position buckets and the head's rescale."""

    feed_forward_act: str  # relu (T5 v1.0) | gelu_new (v1.1, Flan-T5, mT5) | gelu | silu ...
    gated: bool  # v1.1: act(wi_0 x) * wi_1 x
    num_buckets: int = 32
    max_distance: int = 128
    # T5 v1.0 (tied head) multiplies the decoder output by d_model^-0.5 before the head; v1.1 does not.
    scale_decoder_outputs: bool = True


@dataclass(frozen=True)
class BartSettings:
    """BART / mBART: learned positions (offset 2), embedding scale, norms around the layers, head bias."""

    activation: str = "gelu"
    scale_embedding: bool = False
    normalize_before: bool = False  # mBART: pre-norm layers plus final encoder/decoder layer norms
    add_final_layer_norm: bool = False
    layernorm_embedding: bool = True
    encoder_ffn_dim: int = 4096
    encoder_attention_heads: int = 16


@dataclass(frozen=True)
class MllamaSettings:
    """Llama 3.2 Vision (Mllama): which text layers are gated cross-attention layers (indices into the
    whole layer list, as transformers counts them), the image token (outside the head's vocabulary: the
    embedding has 8 rows more) and the image encoder."""

    cross_attention_layers: tuple[int, ...]
    image_token_id: int
    vision: "MllamaVisionSettings"


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # models that take images (llava_next)
    mpt: MptConfig | None = None  # MPT's own settings (model_type "mpt")
    encoder_decoder: EncoderDecoderConfig | None = None  # T5 and BART (num_layers etc. describe the decoder)
    t5: T5Settings | None = None
    bart: BartSettings | None = None
    mllama: MllamaSettings | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Raises ValueError naming what the config lacks, holds wrongly typed, or what we do not serve."""
        check_hf_fields(hf)
        try:
            return cls._from_hf(hf)
        except KeyError as exc:  # a field every config of its family has
            raise ValueError(f"its config.json lacks {exc.args[0]!r}") from exc

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type", "llama")
        if model_type == "llava_next":
            return _llava_next_from_hf(hf)
        if model_type == "mllama":
            return _mllama_from_hf(hf)
        if model_type == "mpt":
            return _mpt_from_hf(hf)
        if model_type in T5_FAMILY:
            return _t5_from_hf(hf)
        if model_type in BART_FAMILY:
            return _bart_from_hf(hf)
        if model_type not in LLAMA_FAMILY:
            supported = ", ".join((*LLAMA_FAMILY, "llava_next", "mllama", "mpt", *T5_FAMILY, *BART_FAMILY))
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding_window = hf.get("sliding_window")
        if model_type == "qwen2" and not hf.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope=_rope_from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _llava_next_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """LLaVA-NeXT: the decoder fields come from `text_config` (so KV cache sizing is the Llama one's),
    the image path from `vision_config` and the top level."""
    from transformers import LlavaNextConfig  # configs only: it fills in the defaults

    try:  # llava-hf configs saved by transformers 4 omit every text/vision field left at its default
        full = LlavaNextConfig.from_dict(hf).to_dict()
    except Exception as e:
        raise ValueError(f"invalid llava_next config: {e}") from e
    text, vision = full["text_config"], full["vision_config"]
    if text.get("model_type") not in LLAMA_FAMILY:
        supported = ", ".join(LLAMA_FAMILY)
        raise ValueError(f"unsupported text_config.model_type {text.get('model_type')!r}; supported: {supported}")
    image_size, num_layers = vision["image_size"], vision["num_hidden_layers"]
    layer = full["vision_feature_layer"]
    layers = (layer,) if isinstance(layer, int) else tuple(layer)
    token = hf.get("image_token_id", full.get("image_token_index"))
    pinpoints = tuple(tuple(p) for p in full.get("image_grid_pinpoints") or ())
    strategy, projector_act = full["vision_feature_select_strategy"], full["projector_hidden_act"]

    _check("vision_config.model_type", vision.get("model_type"), vision.get("model_type") == "clip_vision_model",
           "supported: clip_vision_model")
    _check("vision_config.image_size", image_size, image_size % vision["patch_size"] == 0,
           f"not a multiple of patch_size {vision['patch_size']}")
    _check("vision_config.num_attention_heads", vision["num_attention_heads"],
           vision["hidden_size"] % vision["num_attention_heads"] == 0, "does not divide hidden_size")
    _check("vision_config.hidden_act", vision["hidden_act"], vision["hidden_act"] in VISION_ACTIVATIONS,
           f"supported: {', '.join(VISION_ACTIVATIONS)}")
    _check("projector_hidden_act", projector_act, projector_act in VISION_ACTIVATIONS,
           f"supported: {', '.join(VISION_ACTIVATIONS)}")
    # "full" keeps CLIP's CLS token, which has no place in the any-resolution grid (transformers fails on it).
    _check("vision_feature_select_strategy", strategy, strategy == "default",
           "a CLIP tower has a CLS token; supported: default")
    _check("vision_feature_layer", layer,
           bool(layers) and all(isinstance(i, int) and -num_layers - 1 <= i <= num_layers for i in layers),
           f"each must index the {num_layers + 1} hidden states of the tower")
    _check("image_grid_pinpoints", full.get("image_grid_pinpoints"),
           bool(pinpoints) and all(len(p) == 2 and all(_multiple(x, image_size) for x in p) for p in pinpoints),
           f"need (height, width) pairs, each a positive multiple of vision_config.image_size {image_size}")
    _check("image_token_id", token, isinstance(token, int) and 0 <= token < text["vocab_size"],
           f"not a token of the {text['vocab_size']}-token vocabulary")

    base = ModelConfig.from_hf(text)
    # transformers 5 writes and obeys the top-level flag; transformers 4 obeyed the text config's.
    tie = hf["tie_word_embeddings"] if "tie_word_embeddings" in hf else base.tie_word_embeddings
    return replace(
        base,
        model_type="llava_next",
        tie_word_embeddings=bool(tie),
        vision=VisionConfig(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=num_layers,
            num_heads=vision["num_attention_heads"],
            image_size=image_size,
            patch_size=vision["patch_size"],
            layer_norm_eps=float(vision["layer_norm_eps"]),
            hidden_act=vision["hidden_act"],
            num_channels=vision["num_channels"],
            vision_feature_layer=layer if isinstance(layer, int) else layers,
            vision_feature_select_strategy=strategy,
            image_grid_pinpoints=pinpoints,  # type: ignore[arg-type]
            image_token_id=token,
            projector_hidden_act=projector_act,
            multimodal_projector_bias=bool(full.get("multimodal_projector_bias", True)),
        ),
    )


def _mllama_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Mllama: a Llama text model (`text_config`, its cross-attention layers counted in num_hidden_layers)
    and the vision encoder of `vision_config`."""
    from transformers import MllamaConfig  # configs only: it fills in the defaults

    from loraplex.models.mllama_vision import vision_config_from_hf  # models import this module

    try:
        full = MllamaConfig.from_dict(hf).to_dict()
    except Exception as e:
        raise ValueError(f"invalid mllama config: {e}") from e
    text = full["text_config"]
    layers, vocab = text["num_hidden_layers"], text["vocab_size"]
    cross = tuple(text.get("cross_attention_layers") or ())
    token = hf.get("image_token_index", full.get("image_token_index"))
    _check("text_config.cross_attention_layers", cross,
           all(isinstance(i, int) and 0 <= i < layers for i in cross) and len(set(cross)) == len(cross),
           f"each must index the {layers} text layers once")
    _check("image_token_index", token, isinstance(token, int) and vocab <= token < vocab + 8,
           f"the embedding's extra rows are ids {vocab}..{vocab + 7}")
    base = ModelConfig.from_hf({**text, "model_type": "llama"})
    tie = hf["tie_word_embeddings"] if "tie_word_embeddings" in hf else base.tie_word_embeddings
    _check("tie_word_embeddings", tie, not tie, "the embedding has 8 rows more than the head")
    return replace(
        base,
        model_type="mllama",
        tie_word_embeddings=False,
        mllama=MllamaSettings(tuple(sorted(cross)), token, vision_config_from_hf(full["vision_config"])),
    )


MPT_NORMS = {"layernorm": "layernorm", "low_precision_layernorm": "layernorm",
             "rmsnorm": "rmsnorm", "low_precision_rmsnorm": "rmsnorm"}


def _mpt_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """MPT: transformers' MptConfig dict and MosaicML's config.json alike (`attn_config`, `ffn_config` nested
    dicts; keys a config omits take MosaicML's defaults, except `alibi`, which defaults to True as in
    transformers). Anything we cannot serve exactly is refused, naming the field."""
    attn = dict(hf.get("attn_config") or {})
    ffn = dict(hf.get("ffn_config") or {})
    d_model, n_heads = hf["d_model"], hf["n_heads"]
    alibi = bool(attn.get("alibi", True))

    _check("learned_pos_emb", hf.get("learned_pos_emb"), alibi or not hf.get("learned_pos_emb", True),
           "learned positional embeddings without ALiBi are not supported")
    _check("attn_config.prefix_lm", attn.get("prefix_lm"), not attn.get("prefix_lm"), "prefix-LM attention is not supported")
    _check("attn_config.attn_uses_sequence_id", attn.get("attn_uses_sequence_id"),
           not attn.get("attn_uses_sequence_id"), "sequence-id attention masking is not supported")
    _check("attn_config.rope", attn.get("rope"), not attn.get("rope"), "rotary embeddings in MPT are not supported")
    _check("attn_config.qk_gn", attn.get("qk_gn"), not attn.get("qk_gn"), "q/k GroupNorm is not supported")
    window = attn.get("sliding_window_size", -1)
    _check("attn_config.sliding_window_size", window, window in (-1, None), "sliding-window MPT is not supported")
    ffn_type = ffn.get("ffn_type", "mptmlp")
    _check("ffn_config.ffn_type", ffn_type, ffn_type == "mptmlp", "supported: mptmlp (MoE and GLU FFNs are not)")
    act = ffn.get("ffn_act_fn")
    _check("ffn_config.ffn_act_fn", act,
           act is None or (isinstance(act, dict) and act.get("name") == "gelu" and act.get("approximate", "none") == "none"),
           "supported: exact GELU")
    _check("block_overrides", hf.get("block_overrides"), not hf.get("block_overrides"), "per-block overrides are not supported")
    _check("d_model", d_model, d_model % n_heads == 0, f"not a multiple of n_heads {n_heads}")

    attn_type = attn.get("attn_type", "multihead_attention")
    if attn_type == "multihead_attention":
        kv_heads = n_heads
    elif attn_type == "multiquery_attention":
        kv_heads = 1
    elif attn_type == "grouped_query_attention":
        kv_heads = attn.get("kv_n_heads")
        _check("attn_config.kv_n_heads", kv_heads,
               isinstance(kv_heads, int) and 0 < kv_heads <= n_heads and n_heads % kv_heads == 0,
               f"must divide n_heads {n_heads}")
    else:
        raise ValueError(f"unsupported attn_config.attn_type {attn_type!r}: supported: multihead_attention, "
                         "multiquery_attention, grouped_query_attention")
    norm_type = hf.get("norm_type", "low_precision_layernorm")
    _check("norm_type", norm_type, norm_type in MPT_NORMS, f"supported: {', '.join(MPT_NORMS)}")
    head_dim = d_model // n_heads
    scale = attn.get("softmax_scale")
    logit_scale = hf.get("logit_scale")
    if logit_scale == "inv_sqrt_d_model":
        logit_scale = 1 / math.sqrt(d_model)
    _check("logit_scale", logit_scale, logit_scale is None or isinstance(logit_scale, (int, float)),
           "a number or 'inv_sqrt_d_model'")
    clip = attn.get("clip_qkv")
    _check("attn_config.clip_qkv", clip, clip is None or (isinstance(clip, (int, float)) and clip >= 0), "a number >= 0")
    # transformers' MptForCausalLM builds a 4 * d_model MLP whatever expansion_ratio says, so checkpoints it
    # saved (architectures names its class) have that shape; MosaicML's own code honours expansion_ratio.
    expansion = 4 if "MptForCausalLM" in (hf.get("architectures") or ()) else hf.get("expansion_ratio", 4)
    intermediate = ffn.get("ffn_hidden_size") or int(d_model * expansion)
    no_bias = bool(hf.get("no_bias", True))
    eos = hf.get("eos_token_id")
    return ModelConfig(
        model_type="mpt",
        vocab_size=hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=intermediate,
        num_layers=hf["n_layers"],
        num_heads=n_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("norm_eps", hf.get("layer_norm_epsilon", 1e-5))),
        max_position_embeddings=hf.get("max_seq_len", 2048),
        rope=RopeConfig(),  # unused: MPT has no rotary embeddings
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=not no_bias,
        mlp_bias=not no_bias,
        hidden_act="gelu",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        mpt=MptConfig(
            alibi=alibi,
            alibi_bias_max=float(attn.get("alibi_bias_max", 8)),
            clip_qkv=None if not clip else float(clip),
            qk_ln=bool(attn.get("qk_ln", False)),
            softmax_scale=float(scale) if scale is not None else 1 / math.sqrt(head_dim),
            no_bias=no_bias,
            norm_type=MPT_NORMS[norm_type],
            norm_eps=float(hf.get("norm_eps", hf.get("layer_norm_epsilon", 1e-5))),
            logit_scale=None if logit_scale is None else float(logit_scale),
        ),
    )


T5_ACTIVATIONS = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu")


def _t5_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """T5 v1.0, v1.1 / Flan-T5 and mT5. The shared fields describe the decoder (its layers hold the KV cache)."""
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-") if isinstance(proj, str) else []
    _check("feed_forward_proj", proj, len(parts) in (1, 2) and (len(parts) == 1 or parts[0] == "gated"),
           "expected ACT or gated-ACT")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # transformers reads "gated-gelu" as gelu_new
    _check("feed_forward_proj", proj, act in T5_ACTIVATIONS, f"supported activations: {', '.join(T5_ACTIVATIONS)}")
    d_model, heads, d_kv = hf["d_model"], hf["num_heads"], hf["d_kv"]
    num_layers = hf.get("num_layers", 6)
    # transformers 5 saves `scale_decoder_outputs` and always `tie_word_embeddings: true`; older configs say
    # `tie_word_embeddings: false` for v1.1 (no rescale, own head).
    tie = hf.get("tie_word_embeddings", True) is not False
    # mT5 never rescales (transformers 5's MT5 has no rescale at all; its configs all said untied before).
    scale = hf.get("scale_decoder_outputs", tie) and hf.get("model_type") != "mt5"
    eos = hf.get("eos_token_id", 1)
    start = hf.get("decoder_start_token_id")
    start = hf.get("pad_token_id", 0) if start is None else start
    _check("decoder_start_token_id", start, isinstance(start, int) and 0 <= start < hf["vocab_size"], "not a token id")
    return ModelConfig(
        model_type=hf.get("model_type", "t5"),
        vocab_size=hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=hf["d_ff"],
        num_layers=hf.get("num_decoder_layers") or num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d_kv,
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        max_position_embeddings=UNBOUNDED_POSITIONS,  # relative positions: no learned limit
        rope=RopeConfig(),  # unused
        tie_word_embeddings=tie,
        hidden_act=act,
        bos_token_id=None,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        encoder_decoder=EncoderDecoderConfig(
            num_encoder_layers=num_layers,
            decoder_start_token_id=start,
            forced_bos_token_id=token_id("forced_bos_token_id", hf.get("forced_bos_token_id"), hf["vocab_size"]),
            forced_eos_token_ids=token_ids("forced_eos_token_id", hf.get("forced_eos_token_id"), hf["vocab_size"]),
        ),
        t5=T5Settings(
            feed_forward_act=act,
            gated=len(parts) == 2,
            num_buckets=hf.get("relative_attention_num_buckets", 32),
            max_distance=hf.get("relative_attention_max_distance", 128),
            scale_decoder_outputs=bool(scale),
        ),
    )


BART_ACTIVATIONS = ("gelu", "relu", "gelu_new", "silu", "tanh")


def _bart_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """BART and mBART (mBART: pre-norm layers and final layer norms). Shared fields describe the decoder."""
    model_type = hf.get("model_type", "bart")
    d_model = hf.get("d_model", 1024)
    heads = hf.get("decoder_attention_heads", 16)
    enc_heads = hf.get("encoder_attention_heads", 16)
    act = hf.get("activation_function", "gelu")
    _check("activation_function", act, act in BART_ACTIVATIONS, f"supported: {', '.join(BART_ACTIVATIONS)}")
    _check("decoder_attention_heads", heads, d_model % heads == 0, f"does not divide d_model {d_model}")
    _check("encoder_attention_heads", enc_heads, d_model % enc_heads == 0, f"does not divide d_model {d_model}")
    mbart = model_type == "mbart"
    eos = hf.get("eos_token_id", 2)
    # mBART's config has none (transformers' generate then starts from bos_token_id); BART's default is 2.
    start = hf.get("decoder_start_token_id", None if mbart else 2)
    start = hf.get("bos_token_id", 0) if start is None else start
    _check("decoder_start_token_id", start, isinstance(start, int) and 0 <= start < hf["vocab_size"], "not a token id")
    positions = hf.get("max_position_embeddings", 1024)
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=hf.get("decoder_ffn_dim", 4096),
        num_layers=hf.get("decoder_layers", 12),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d_model // heads,
        rms_norm_eps=1e-5,  # nn.LayerNorm's default, which BART uses
        max_position_embeddings=positions,
        rope=RopeConfig(),  # unused
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_act=act,
        bos_token_id=hf.get("bos_token_id", 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        encoder_decoder=EncoderDecoderConfig(
            num_encoder_layers=hf.get("encoder_layers", 12),
            decoder_start_token_id=start,
            max_source_positions=positions,
            forced_bos_token_id=token_id("forced_bos_token_id", hf.get("forced_bos_token_id"), hf["vocab_size"]),
            forced_eos_token_ids=token_ids("forced_eos_token_id", hf.get("forced_eos_token_id", 2), hf["vocab_size"]),
        ),
        bart=BartSettings(
            activation=act,
            scale_embedding=bool(hf.get("scale_embedding", False)),
            # transformers decides by model_type alone: BART configs' fairseq keys (normalize_before,
            # add_final_layer_norm, normalize_embedding ...) are ignored, mBART is always pre-norm.
            normalize_before=mbart,
            add_final_layer_norm=mbart,
            layernorm_embedding=True,
            encoder_ffn_dim=hf.get("encoder_ffn_dim", 4096),
            encoder_attention_heads=enc_heads,
        ),
    )


# Families whose positions are relative (T5) have no learned position limit; the engine's limits apply.
UNBOUNDED_POSITIONS = 1 << 30


def token_id(field: str, value: Any, vocab_size: int) -> int | None:
    """A config's optional token id (None stays None), checked against the vocabulary."""
    if value is not None:
        _check(field, value, isinstance(value, int) and 0 <= value < vocab_size, "not a token id")
    return value


def token_ids(field: str, value: Any, vocab_size: int) -> tuple[int, ...]:
    """A config's token id or list of them, as a tuple (None: empty)."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(token_id(field, v, vocab_size) for v in values)


def _check(field: str, value: Any, ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(f"unsupported {field} {value!r}: {why}")


def _multiple(x: Any, of: int) -> bool:
    return isinstance(x, int) and x > 0 and x % of == 0


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
    "sliding_window": ("int", *_TOKEN),  # 0 in some configs that turn it off (use_sliding_window false)
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"), ("num", 0, 1)),
    "rope_theta": ("num", 1, 10**12), "alibi_bias_max": ("num", 0, 1000), "expansion_ratio": ("num", *_FACTOR),
    **dict.fromkeys(("factor", "low_freq_factor", "high_freq_factor"), ("num", *_FACTOR)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "no_bias",
                     "scale_embedding", "qk_ln", "alibi", "multimodal_projector_bias", "scale_decoder_outputs"),
                    ("bool", 0, 0)),
    **dict.fromkeys(("model_type", "hidden_act", "activation_function", "feed_forward_proj", "norm_type",
                     "projector_hidden_act", "rope_type", "type"), ("str", 0, 0)),
    **dict.fromkeys(("text_config", "vision_config", "attn_config", "ffn_config", "rope_scaling", "rope_parameters"),
                    ("object", 0, 0)),
}
# Fields the families read as "absent" when null (`x or default`, `x is None`); any other may not be null.
HF_NULLABLE = frozenset({
    "num_key_value_heads", "head_dim", "sliding_window", "num_decoder_layers", "kv_n_heads", "ffn_hidden_size",
    "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_bos_token_id",
    "forced_eos_token_id", "image_token_id", "image_token_index", "text_config", "vision_config", "attn_config",
    "ffn_config", "rope_scaling", "rope_parameters",
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


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older versions `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    low, high = merged.get("low_freq_factor", 1.0), merged.get("high_freq_factor", 4.0)
    _check("rope_scaling.high_freq_factor", high, kind != "llama3" or high > low, f"must exceed low_freq_factor {low}")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(low),
        high_freq_factor=float(high),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class EngineConfig:
    model_id: str | None = None  # None: the embedded default model
    revision: str | None = None  # of a hub model: branch, tag or commit (None: main)
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    max_batch_prefill_tokens: int = 4096  # prompt tokens computed per step
    max_batch_total_tokens: int | None = None  # KV cache capacity in tokens; None: sized from memory
    max_num_seqs: int = 256  # requests running at once
    max_input_length: int = 4095
    max_total_tokens: int = 4096
    # Of free device memory (default 0.85 on CUDA; on CPU 0.1 of available RAM, at most 2 GiB), when
    # max_batch_total_tokens is None.
    kv_cache_memory_fraction: float | None = None
    # LoRA: device slots (distinct adapters one step can run), the largest rank served, and how long an
    # adapter keeps its slot before yielding it to waiting adapters when there are more than slots.
    max_active_adapters: int = 128
    max_lora_rank: int = 64
    adapter_cycle_time_s: float = 2.0
    chat_template: str | None = None  # a Jinja chat template file, for checkpoints that ship none (or to override)
    quantize: str | None = None  # bitsandbytes | bitsandbytes-nf4 | bitsandbytes-fp4 (LoRAX's --quantize)
    # Share computed KV blocks between requests with the same prefix, adapter and images (exact: a hit holds
    # the keys and values the request would compute itself).
    prefix_caching: bool = True
    # Speculative decoding (LoRAX's --speculative-tokens): up to this many tokens guessed per request and step
    # by n-gram lookup in its own tokens, verified by the model in one step; outputs unchanged. 0: off.
    speculative_tokens: int = 0
    # Structured output: the largest grammar text (a JSON schema, regex or choice list) and the longest
    # compile a request may ask for.
    max_grammar_bytes: int = 64 * 1024
    grammar_compile_timeout_s: float = 10.0
    # CUDA (with Triton): decode steps of up to max_num_seqs (at most 256) requests replay CUDA graphs
    # (engine/decode_graphs.py). Off: every step runs eagerly (vLLM's --enforce-eager). No effect on CPU.
    cuda_graphs: bool = True
    # Overlapped decode steps (engine/overlap.py): the next step is launched before the host reads the last one's
    # tokens, so the host's work runs while the GPU computes. None: where decode steps run as CUDA graphs and
    # speculative decoding is off. True on a CPU runs the same bookkeeping with eager steps (no gain; for tests).
    overlap_steps: bool | None = None
    # Where decode steps replay CUDA graphs, waiting requests join running ones only after this many steps
    # without a join, or once the queue is `waiting_served_ratio` times the running requests, or when a step
    # runs eagerly anyway (engine/joins.py; LoRAX's --max-waiting-tokens and --waiting-served-ratio). Elsewhere
    # they join at every step. 0: at every step.
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 1.2
    # Before the first request, made-up requests compile the kernels and capture the decode graphs
    # (engine/warm_up.py). None: on CUDA only (a CPU has nothing to compile or capture).
    warm_up: bool | None = None
    # CUDA memory: the fraction of the device this process may use (LoRAX's --cuda-memory-fraction), and the
    # fraction at most kept out of the KV cache for adapter weights (LoRAX's --adapter-memory-fraction).
    cuda_memory_fraction: float = 1.0
    adapter_memory_fraction: float = 0.1


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-edge limits and options (LoRAX's flag names and defaults where they apply)."""

    max_concurrent_requests: int = 128
    # Admission limit on queued work: prompt + max_new_tokens of the requests in flight (admitted, not finished:
    # waiting, preempted or running). A request past it gets 429 + Retry-After; one is always admitted when
    # nothing is in flight. None: off (the concurrency limit and the engine's queue alone).
    max_queued_tokens: int | None = None
    max_stop_sequences: int = 4
    max_best_of: int = 2
    default_max_new_tokens: int = 20  # when a request names none
    request_timeout_s: float | None = None  # a request still running after this long is aborted (504 if unanswered)
    api_keys: tuple[str, ...] = ()  # when set, every route but /health needs `Authorization: Bearer KEY`
    # Request bodies larger than this are refused (413) before they are parsed (TGI's --payload-limit). Images
    # sent as data URLs count: raise it for many large ones.
    max_request_bytes: int = 32 * 1024 * 1024
    validation_workers: int = 2
    json_output: bool = False
    cors_allow_origin: tuple[str, ...] = ()
    # Adapters: the default source (local | hub), the directories local adapters must live in (none:
    # local loading off), adapters loaded at start, and how many loaded adapters the CPU cache keeps.
    adapter_source: str = "hub"
    adapter_roots: tuple[str, ...] = ()
    preloaded_adapter_ids: tuple[str, ...] = ()
    max_cpu_adapters: int = 64
    # How long the hub's answer on whether a request's api_token may read a hub adapter is reused for
    # requests with the same token (and repo); 0: every request asks the hub (lora/hub_source.py).
    adapter_access_ttl_s: float = 30.0
    # Images: where they may come from and how large they may be (vLLM's names; see multimodal/config.py).
    media: MediaConfig = field(default_factory=MediaConfig)
