"""Configuration: the normalised model config and the engine's settings.

`ModelConfig.from_hf` is where Hugging Face config quirks stop: every family's config.json (old and new
transformers spellings alike) becomes one flat, frozen description that our model code reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from loraplex.multimodal.config import MediaConfig

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
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

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type", "llama")
        if model_type == "llava_next":
            return _llava_next_from_hf(hf)
        if model_type not in LLAMA_FAMILY:
            supported = ", ".join((*LLAMA_FAMILY, "llava_next"))
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


def _check(field: str, value: Any, ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(f"unsupported {field} {value!r}: {why}")


def _multiple(x: Any, of: int) -> bool:
    return isinstance(x, int) and x > 0 and x % of == 0


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older versions `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class EngineConfig:
    model_id: str | None = None  # None: the embedded default model
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


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-edge limits and options (LoRAX's flag names and defaults where they apply)."""

    max_concurrent_requests: int = 128
    max_stop_sequences: int = 4
    max_best_of: int = 2
    default_max_new_tokens: int = 20  # when a request names none
    json_output: bool = False
    cors_allow_origin: tuple[str, ...] = ()
    # Adapters: the default source (local | hub), the directories local adapters must live in (none:
    # local loading off), adapters loaded at start, and how many loaded adapters the CPU cache keeps.
    adapter_source: str = "hub"
    adapter_roots: tuple[str, ...] = ()
    preloaded_adapter_ids: tuple[str, ...] = ()
    max_cpu_adapters: int = 64
    # Images: where they may come from and how large they may be (vLLM's names; see multimodal/config.py).
    media: MediaConfig = field(default_factory=MediaConfig)
