"""Configuration: the normalised model config and the engine's and server's settings.

`ModelConfig` is what our model code reads: one flat, frozen description of a checkpoint, built from its
config.json by its family's normaliser (models/registry.py `config_from_hf`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.multimodal.config import MediaConfig
from loraplex.settings import _fraction, _non_negative, _positive, _positive_float, setting

KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype (layers/kv_quant.py)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | dynamic | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # The pretraining context. dynamic and longrope choose each row's frequencies by whether its sequence is longer
    # (dynamic: transformers' max_position_embeddings; longrope: Phi-3's original_max_position_embeddings).
    original_max_position_embeddings: int = 8192
    # YaRN: the band of dimensions between beta_fast and beta_slow rotations over the original context is
    # interpolated; cos and sin are scaled by attention_factor (YaRN's and LongRoPE's; 1.0 for every other kind).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # LongRoPE: each frequency divided by its factor, the long ones in sequences past the original context.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # Rotary on the first int(head_dim * partial_rotary_factor) dims of each head, the rest passed through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


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


@dataclass(frozen=True)
class MoeSettings:
    """A sparse mixture-of-experts feed-forward in place of the MLP (Mixtral, Qwen2-MoE): a router picks each
    token's `top_k` of `num_experts` gated MLPs (layers/moe.py)."""

    num_experts: int  # Mixtral's num_local_experts, Qwen2-MoE's num_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of each expert (Qwen2-MoE's moe_intermediate_size; Mixtral's intermediate_size)
    renormalize: bool  # the top-k probabilities rescaled to sum to 1 (Mixtral always; Qwen2-MoE's norm_topk_prob)
    # The top-k weights rounded to the model's dtype before they scale the experts' outputs (Qwen2-MoE), or kept
    # float32 (Mixtral), as transformers does.
    weights_in_model_dtype: bool
    # Which layers are sparse (Qwen2-MoE's decoder_sparse_step and mlp_only_layers); the others keep the dense
    # MLP of ModelConfig.intermediate_size.
    sparse_layers: tuple[bool, ...]
    # A shared expert beside the routed ones, gated by sigmoid(shared_expert_gate(x)) (Qwen2-MoE); 0: none.
    shared_expert_intermediate_size: int = 0


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
# command line from them, in declaration order (the order of --help).
@dataclass(frozen=True)
class EngineConfig:
    model_id: str | None = setting(
        help="HF directory, cached repo id or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    dtype: str | None = setting(choices=("float32", "bfloat16", "float16"))  # None: float32 on CPU, bfloat16 on CUDA
    device: str | None = setting(help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    max_input_length: int = setting(4095, type=_positive)
    max_total_tokens: int = setting(4096, type=_positive)
    max_batch_prefill_tokens: int = setting(4096, type=_positive)  # prompt tokens computed per step
    max_batch_total_tokens: int | None = setting(
        type=_positive, help="KV cache capacity in tokens (default: sized from free memory)")
    # Of free device memory (default 0.85 on CUDA; on CPU 0.1 of available RAM, at most 2 GiB), when
    # max_batch_total_tokens is None.
    kv_cache_memory_fraction: float | None = None
    block_size: int = 16
    max_num_seqs: int = 256  # requests running at once
    # LoRA: device slots (distinct adapters one step can run), the largest rank served, and how long an
    # adapter keeps its slot before yielding it to waiting adapters when there are more than slots.
    max_active_adapters: int = setting(128, type=_positive,
                                       help="device slots for adapters: distinct adapters one step can run")
    max_lora_rank: int = setting(64, type=_positive)
    adapter_cycle_time_s: float = setting(2.0, type=float, help="when more adapters wait than slots exist, how long "
                                                                "one keeps its slot before yielding it")
    chat_template: str | None = setting(help="a Jinja chat template file (for checkpoints that ship none, e.g. MPT)")
    # LoRAX's --quantize; its choices are quantization's QUANTIZE_CHOICES, which cli.py supplies (config.py
    # imports nothing from quantization).
    quantize: str | None = setting(
        help="quantize a float checkpoint's linears as it loads: bitsandbytes int8 (LLM.int8), nf4 or fp4, or fp8 "
             "(e4m3, CUDA compute capability 8.9+); pre-quantized GPTQ, AWQ, FP8 and compressed-tensors checkpoints "
             "load as published without it (LoRA adapters run on top in the model's dtype)")
    # What the paged KV cache stores: "auto" the model's dtype; "fp8" float8 e4m3, half the bytes of bfloat16 per
    # token (twice the tokens), scaled per layer and KV head (layers/kv_quant.py). LoRAX's fp8-kv, vLLM's name.
    kv_cache_dtype: str = setting(
        "auto", choices=KV_CACHE_DTYPES,
        help="what the paged KV cache stores: auto (the model's dtype) or fp8 (e4m3 with per-layer scales: half the "
             "bytes of bfloat16, twice the tokens; CPU, or CUDA compute capability 8.9+)")
    # Share computed KV blocks between requests with the same prefix, adapter and images (exact: a hit holds
    # the keys and values the request would compute itself).
    prefix_caching: bool = setting(
        True, action="negatable",
        help="share computed KV blocks between requests with the same prompt prefix, adapter and images (on by "
             "default; outputs are unchanged)")
    # CUDA (with Triton): decode steps of up to max_num_seqs (at most 256) requests replay CUDA graphs
    # (engine/worker/decode_graphs.py). Off: every step runs eagerly (vLLM's --enforce-eager). No effect on CPU.
    cuda_graphs: bool = setting(
        True, action="negatable",
        help="on CUDA, replay decode steps as CUDA graphs (on by default; --no-cuda-graphs runs every step eagerly; "
             "no effect on CPU)")
    # Before the first request, made-up requests compile the kernels and capture the decode graphs
    # (engine/warm_up.py). None: on CUDA only (a CPU has nothing to compile or capture).
    warm_up: bool | None = setting(
        action="negatable",
        help="before serving, run made-up requests that compile the kernels and capture the decode graphs, so the "
             "first requests do not wait for them (default: on CUDA only)")
    # Overlapped decode steps (engine/worker/overlap.py): the next step is launched before the host reads the last one's
    # tokens, so the host's work runs while the GPU computes. None: where decode steps run as CUDA graphs and
    # speculative decoding is off. True on a CPU runs the same bookkeeping with eager steps (no gain; for tests).
    overlap_steps: bool | None = setting(
        action="negatable",
        help="launch each decode step before the host has read the last one's tokens (default: on with CUDA graphs; "
             "outputs unchanged)")
    # Where decode steps replay CUDA graphs, waiting requests join running ones only after this many steps
    # without a join, or once the queue is `waiting_served_ratio` times the running requests, or when a step
    # runs eagerly anyway (engine/scheduling/joins.py; LoRAX's --max-waiting-tokens and --waiting-served-ratio). Elsewhere
    # they join at every step. 0: at every step.
    max_waiting_tokens: int = setting(
        20, type=_non_negative,
        help="with CUDA graphs: decode steps a waiting request may wait before it joins the running ones (0: it "
             "joins at every step)")
    waiting_served_ratio: float = setting(
        1.2, type=_positive_float,
        help="with CUDA graphs: waiting requests join at once when they number at least this many times the "
             "running ones")
    # Speculative decoding (LoRAX's --speculative-tokens): up to this many tokens guessed per request and step
    # by n-gram lookup in its own tokens, verified by the model in one step; outputs unchanged. 0: off.
    speculative_tokens: int = setting(
        0, type=_non_negative,
        help="speculative decoding: up to N tokens per step guessed from each request's own text (n-gram lookup) "
             "and verified by the model; outputs unchanged (default 0: off)")
    # Structured output: the largest grammar text (a JSON schema, regex or choice list) and the longest
    # compile a request may ask for.
    max_grammar_bytes: int = setting(
        64 * 1024, type=int,
        help="structured output: the largest JSON schema / regex / choice list a request may send")
    grammar_compile_timeout_s: float = setting(
        10.0, type=float, help="structured output: a grammar that takes longer to compile is refused")
    revision: str | None = setting(help="a hub model's branch, tag or commit (default: main)")
    # CUDA memory: the fraction of the device this process may use (LoRAX's --cuda-memory-fraction), and the
    # fraction at most kept out of the KV cache for adapter weights (LoRAX's --adapter-memory-fraction).
    cuda_memory_fraction: float = setting(1.0, type=_fraction,
                                          help="the share of the GPU's memory this server may use")
    adapter_memory_fraction: float = setting(
        0.1, type=_fraction,
        help="at most this share of the GPU's memory is kept out of the KV cache for adapter weights")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-edge limits and options (LoRAX's flag names and defaults where they apply)."""

    # Adapters: the default source, the directories local adapters must live in (none: local loading off), adapters
    # loaded at start, and how many loaded adapters the CPU cache keeps. The first two are `generate`'s flags too.
    adapter_source: str = setting("hub", choices=("hub", "local", "s3"),
                                  help="where adapter ids are looked up unless a request says otherwise")
    adapter_roots: tuple[str, ...] = setting(
        (), flag="--adapter-root", action="append",
        help="directory local adapters may be loaded from (repeatable; none: local adapters off)")
    max_concurrent_requests: int = setting(
        128, type=_positive, help="requests in flight at once; more get 429 with a Retry-After header")
    # Admission limit on queued work: prompt + max_new_tokens of the requests in flight (admitted, not finished:
    # waiting, preempted or running). A request past it gets 429 + Retry-After; one is always admitted when
    # nothing is in flight. None: off (the concurrency limit and the engine's queue alone).
    max_queued_tokens: int | None = setting(
        type=_positive,
        help="prompt + max_new_tokens of the requests in flight (admitted, not finished: waiting, preempted or "
             "running); a request past it gets 429 with a Retry-After header, but one is always admitted when none "
             "is in flight (default: off; a few times the KV cache, /info's max_batch_total_tokens, bounds the "
             "queue's wait)")
    max_stop_sequences: int = setting(4, type=int)
    max_best_of: int = setting(2, type=int)
    json_output: bool = setting(False, action="store_true")
    default_max_new_tokens: int = 20  # when a request names none
    # OpenAI requests without max_tokens: chat generates up to the context limit, completions 16 tokens (OpenAI's
    # defaults); this caps both when set (off, as in vLLM).
    default_max_tokens: int | None = setting(
        type=_positive,
        help="cap what an OpenAI request without max_tokens generates (chat: up to the context limit otherwise; "
             "completions: 16)")
    # The model's generation_config.json sampling values are the OpenAI routes' defaults where a request sets none
    # (vLLM's default), or not; the native API never takes them (LoRAX's behaviour).
    generation_config: str = setting(
        "auto", choices=("auto", "ignore"),
        help="auto: OpenAI requests take the model's generation_config.json temperature, top_p, top_k, min_p and "
             "repetition_penalty where they set none (as vLLM); ignore: they do not. The native API never takes "
             "them (as LoRAX)")
    request_timeout_s: float | None = setting(
        type=float, help="abort a request still running after this many seconds (504 when nothing was sent yet)")
    # TGI's --payload-limit. Images sent as data URLs count: raise it for many large ones.
    max_request_bytes: int = setting(32 * 1024 * 1024, type=int,
                                     help="refuse request bodies larger than this (413), before parsing them")
    api_keys: tuple[str, ...] = setting(
        (), flag="--api-key", action="append",
        help="require this key (Authorization: Bearer KEY) on every route but /health and /ping (GET, HEAD) and "
             "OPTIONS (repeatable; the environment variable takes a comma-separated list)")
    cors_allow_origin: tuple[str, ...] = setting(
        (), action="append",
        help="answer browsers from this origin (repeatable): preflights and every response, 401s included, carry "
             "the CORS headers")
    preloaded_adapter_ids: tuple[str, ...] = setting(
        (), nargs="+", help="adapters (of --adapter-source) loaded at start and listed by /v1/models")
    max_cpu_adapters: int = setting(64, type=int,
                                    help="loaded adapters kept in host memory besides the preloaded ones (LRU)")
    # lora/sources/hub_source.py
    adapter_access_ttl_s: float = setting(
        30.0, type=float,
        help="how long the hub's answer on whether a request's api_token may read a hub adapter is reused for "
             "requests with the same token (0: every request asks the hub)")
    validation_workers: int = setting(
        2, type=_positive,
        help="threads that tokenize prompts, render chat templates and build /tokenize's answers, off the event loop")
    # Images: where they may come from and how large they may be (vLLM's names; see multimodal/config.py).
    media: MediaConfig = field(default_factory=MediaConfig)
