"""The engine's and the server's settings, each declared once (settings.py builds the CLI from them).

The model's own description (`ModelConfig` and the families' settings) lives beside the models
(models/config.py); the layers' settings beside the layers (`RopeConfig` in layers/rotary.py, `MoeSettings` in
layers/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.multimodal.config import MediaConfig
from loraplex.settings import _fraction, _non_negative, _non_negative_float, _positive, _positive_float, setting

KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype (layers/kv_quant.py)


@dataclass(frozen=True)
class EngineConfig:
    model_id: str | None = setting(
        help="HF directory, cached repo id or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    dtype: str | None = setting(choices=("float32", "bfloat16", "float16"))  # None: float32 on CPU, bfloat16 on CUDA
    device: str | None = setting(help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    # None: derived as TGI derives them (engine/engine.py resolve_lengths): max_total_tokens the model's context,
    # at most 4096 (more when max_input_length asks), and max_input_length max_total_tokens - 1. The engine's config
    # holds the numbers it serves.
    max_input_length: int | None = setting(
        type=_positive, help="the longest prompt in tokens (default: --max-total-tokens - 1)")
    max_total_tokens: int | None = setting(
        type=_positive,
        help="the longest sequence, prompt + generated tokens, one request may reach; at most the model's context "
             "(default: the model's context, at most 4096, or --max-input-length + 1 when that is more)")
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
    adapter_cycle_time_s: float = setting(2.0, type=_non_negative_float,
                                          help="when more adapters wait than slots exist, how long one keeps its slot "
                                               "before yielding it (0: it yields as soon as others wait)")
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
        64 * 1024, type=_positive,
        help="structured output: the largest JSON schema / regex / choice list a request may send")
    grammar_compile_timeout_s: float = setting(
        10.0, type=_positive_float, help="structured output: a grammar that takes longer to compile is refused")
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
    max_sequences_per_request: int | None = setting(
        type=_positive, help="sequences one request may make (n x prompts, best_of), each taking a seat of "
                             "--max-concurrent-requests (default: a quarter of them, at least 1)")
    # Admission limit on queued work: prompt + max_new_tokens of the requests in flight (admitted, not finished:
    # waiting, preempted or running). A request past it gets 429 + Retry-After; one is always admitted when
    # nothing is in flight. None: off (the concurrency limit and the engine's queue alone).
    max_queued_tokens: int | None = setting(
        type=_positive,
        help="prompt + max_new_tokens of the requests in flight (admitted, not finished: waiting, preempted or "
             "running); a request past it gets 429 with a Retry-After header, but one is always admitted when none "
             "is in flight (default: off; a few times the KV cache, /info's max_batch_total_tokens, bounds the "
             "queue's wait)")
    # Embeddings: how the routes pool the prompt's final hidden rows (None: as the checkpoint's sentence-transformers
    # files say, else the last token's, L2-normalised).
    pooling: str | None = setting(choices=("last", "mean", "cls", "max"),
                                  help="embeddings: the pooling over the prompt's final hidden states (default: the "
                                       "checkpoint's sentence-transformers pooling, else the last token's; "
                                       "L2-normalised unless the checkpoint says otherwise)")
    max_stop_sequences: int = setting(4, type=_non_negative, help="stop sequences a request may send (0: none)")
    # How many entries each list of a request may have, counted before any work per entry (server/limits.py).
    max_messages: int = setting(4096, type=_positive, help="chat messages in one request")
    max_content_parts: int = setting(4096, type=_positive, help="content parts (text, images) of one request's messages")
    max_tools: int = setting(512, type=_positive, help="tool definitions in one chat request")
    max_stop_token_ids: int = setting(1024, type=_positive, help="stop_token_ids of one request")
    max_logit_bias: int = setting(1024, type=_positive, help="logit_bias entries of one request")
    max_bad_words: int = setting(128, type=_positive, help="bad_words of one request")
    max_allowed_token_ids: int = setting(262144, type=_positive, help="allowed_token_ids of one request")
    max_best_of: int = setting(2, type=_positive)
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
        type=_positive_float,
        help="abort a request still running after this many seconds (504 when nothing was sent yet; default: never)")
    # TGI's --payload-limit. Images sent as data URLs count: raise it for many large ones.
    max_request_bytes: int = setting(32 * 1024 * 1024, type=_positive,
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
    max_cpu_adapters: int = setting(
        64, type=_non_negative,
        help="loaded adapters kept in host memory besides the preloaded ones (LRU; 0: each is read again when a "
             "request next needs it)")
    adapter_load_threads: int | None = setting(
        type=_positive,
        help="adapters read, checked and laid out at once, beside the engine, in arrival order (the others queue; "
             "default: half the CPU cores, 2 to 8)")
    # Adapters served under names the operator chose (lora/sources/named.py), at start-up or at run time.
    lora_modules: tuple[str, ...] = setting(
        (), nargs="+",
        help="adapters served under a name clients send as `model` or `adapter_id`: name=path, or JSON "
             "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}; path: a local directory, hub repo id or s3:// URI")
    served_model_name: tuple[str, ...] = setting(
        (), nargs="+",
        help="the base model's name in /v1/models, in answers' `model` and in metrics (default: its model id); "
             "further names are aliases requests may send")
    default_adapter_id: str | None = setting(
        flag="--adapter-id",
        help="the adapter a request that names none is served with (LoRAX's --adapter-id; OpenAI requests without "
             "`model`; one that names the base model still gets the base); loaded at start")
    allow_runtime_lora_updating: bool = setting(
        False, action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and SGLang's /load_lora_adapter, "
             "/unload_lora_adapter); they need the API key when --api-key is set")
    # lora/sources/hub_source.py
    adapter_access_ttl_s: float = setting(
        30.0, type=_non_negative_float,
        help="how long the hub's answer on whether a request's api_token may read a hub adapter is reused for "
             "requests with the same token (0: every request asks the hub)")
    validation_workers: int = setting(
        2, type=_positive,
        help="threads that tokenize prompts, render chat templates and build /tokenize's answers, off the event loop")
    # Images: where they may come from and how large they may be (vLLM's names; see multimodal/config.py).
    media: MediaConfig = field(default_factory=MediaConfig)


# `serve --help`'s topics, in its order: each one's title, a line saying what it holds, and the settings listed under
# it (in their declaration order). Every setting of EngineConfig and ServerConfig is named once here: building the
# command line fails for one that is not (settings.add_arguments). cli.py adds its own flags to these topics too.
HELP_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": ("the checkpoint served and how it loads", (
        "model_id", "revision", "dtype", "device", "quantize", "chat_template")),
    "adapters": ("LoRA adapters: where they come from, which are served from the start, how many the GPU and the "
                 "host keep", (
        "adapter_source", "adapter_roots", "max_active_adapters", "max_lora_rank", "adapter_cycle_time_s",
        "preloaded_adapter_ids", "lora_modules", "default_adapter_id", "max_cpu_adapters", "adapter_load_threads",
        "adapter_access_ttl_s", "allow_runtime_lora_updating")),
    "scheduling and memory": ("sequence lengths, batches, the KV cache, GPU memory and how decode steps run", (
        "max_input_length", "max_total_tokens", "max_batch_prefill_tokens", "max_batch_total_tokens",
        "kv_cache_dtype", "prefix_caching", "cuda_graphs", "warm_up", "overlap_steps", "max_waiting_tokens",
        "waiting_served_ratio", "speculative_tokens", "cuda_memory_fraction", "adapter_memory_fraction")),
    "server": ("where it listens, who may call it, and how it answers and stops", (
        "json_output", "default_max_tokens", "generation_config", "api_keys", "cors_allow_origin",
        "served_model_name", "validation_workers", "pooling")),
    "limits": ("what one request may send or ask for (more is refused), how many run at once and for how long, "
               "and where images may come from", (
        "max_grammar_bytes", "grammar_compile_timeout_s", "max_concurrent_requests",
        "max_sequences_per_request", "max_queued_tokens",
        "max_stop_sequences", "max_messages", "max_content_parts", "max_tools", "max_stop_token_ids",
        "max_logit_bias", "max_bad_words", "max_allowed_token_ids", "max_best_of", "request_timeout_s",
        "max_request_bytes")),
    "observability": ("traces (Prometheus metrics are always served at /metrics)", ()),
}
