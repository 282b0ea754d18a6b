"""Configuration: the normalised model config and the engine's settings.

`ModelConfig.from_hf` is where Hugging Face config quirks stop: every family's config.json (old and new
transformers spellings alike) becomes one flat, frozen description that our model code reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type", "llama")
        if model_type not in LLAMA_FAMILY:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(LLAMA_FAMILY)}")
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
