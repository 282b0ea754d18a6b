"""The normalised model config: what our model code reads, one flat, frozen description of a checkpoint, built
from its config.json by its family's normaliser (models/registry.py `config_from_hf`), with the settings of the
families that need more (vision towers, MPT, encoder-decoders, Mllama, mixtures of experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.layers.moe import MoeSettings
from loraplex.layers.rotary import RopeConfig


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-NeXT or LLaVA 1.5 image path: the CLIP vision tower, which of its layers feed the projector, and
    how each image's tiles become its placeholder tokens (any-resolution grid, `image_newline`; or one tile)."""

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
    # LLaVA-NeXT / LLaVA 1.5
    vision_feature_layer: int | tuple[int, ...]  # hidden-state index (0: embeddings); several: concatenated
    vision_feature_select_strategy: str  # "default": drop the CLS token; "full" (LLaVA 1.5 only): keep it
    # (height, width) resolutions an image may be tiled to; empty: one tile per image (LLaVA 1.5)
    image_grid_pinpoints: tuple[tuple[int, int], ...]
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
    # Untied checkpoints (tie_word_embeddings false, as transformers 5 saves them) hold the encoder's and decoder's
    # token embeddings apart from `model.shared`: each stack then reads its own (build_model decides it).
    stack_embeddings: bool = False


@dataclass(frozen=True)
class MllamaVisionSettings:
    """The Mllama image encoder (models/mllama_vision.py), from transformers' MllamaVisionConfig."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # local transformer
    num_global_layers: int
    num_heads: int
    image_size: int  # side of one square tile, in pixels
    patch_size: int
    num_channels: int
    max_num_tiles: int
    num_aspect_ratios: int  # len(supported_aspect_ratios): ids run 0 (padding) .. this
    intermediate_layers_indices: tuple[int, ...]  # local layers whose outputs join the final states
    norm_eps: float
    hidden_act: str
    vision_output_dim: int

    @property
    def num_patches(self) -> int:
        """Tokens per tile as the text model's cross-attention mask counts them: patches + CLS."""
        return (self.image_size // self.patch_size) ** 2 + 1


@dataclass(frozen=True)
class MllamaSettings:
    """Llama 3.2 Vision (Mllama): which text layers are gated cross-attention layers (indices into the
    whole layer list, as transformers counts them), the image token (outside the head's vocabulary: the
    embedding has 8 rows more) and the image encoder."""

    cross_attention_layers: tuple[int, ...]
    image_token_id: int
    vision: MllamaVisionSettings


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    output_bias: bool = False  # the attention output projection's bias (Llama, Qwen3, Gemma with attention_bias)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Which layers attend within sliding_window (transformers' layer_types: Qwen2/Qwen3 slide only the layers from
    # max_window_layers on); None: every layer does, when sliding_window is set.
    sliding_layers: tuple[bool, ...] | None = None
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotary embedding (Qwen3)
    # The checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3; PEFT names them so).
    fused_projections: bool = False
    norm_offset: float = 0.0  # RMSNorms scale by offset + weight (Gemma: 1, its weights stored as the difference)
    embedding_scale: float | None = None  # token embeddings times this, in the model's dtype (Gemma: sqrt(hidden))
    # Gemma 2: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); scores and final logits
    # soft-capped (s -> cap * tanh(s / cap)); a norm after attention and one each side of the MLP ("sandwich").
    attention_scale: float | None = None
    attention_softcap: float | None = None
    final_logit_softcap: float | None = None
    sandwich_norms: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # generation_config.json's sampling values, (name, value) for those it sets of SAMPLING_DEFAULT_FIELDS: what the
    # OpenAI routes use where a request sets none (ServerConfig.generation_config), as vLLM does.
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    vision: VisionConfig | None = None  # models that take images (llava_next)
    mpt: MptConfig | None = None  # MPT's own settings (model_type "mpt")
    encoder_decoder: EncoderDecoderConfig | None = None  # T5 and BART (num_layers etc. describe the decoder)
    t5: T5Settings | None = None
    bart: BartSettings | None = None
    mllama: MllamaSettings | None = None
    moe: MoeSettings | None = None  # Mixtral, Qwen2-MoE: sparse expert layers


# EngineConfig's and ServerConfig's settings are declared once, here: `setting` gives each its flag (the name's, or
# `flag`), help text, environment variable (the flag's name in capitals, LoRAX's) and parser; cli.py builds the
# command line from them, grouped by topic (config.HELP_GROUPS) and in declaration order within a group.
