"""Shared test helpers: tiny random models with a transformers twin, and a direct logits probe."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel, build_model
from loraplex.engine.requests.request import Request
from loraplex.engine.worker.runner import ModelRunner
from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.layers.forward_context import ForwardContext, forward_context
from loraplex.lora.adapter import LoraAdapter
from loraplex.models.registry import config_from_hf
from loraplex.lora.step.plan import LoraPlan
from loraplex.lora.step.row_maps import LoraSegment
from loraplex.lora.device.table import AdapterTable
from loraplex.params import SamplingParams


def tiny_hf_model(kind: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random-weight transformers model of a tiny config of the given family."""
    import transformers

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    )
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
        "phi3": transformers.Phi3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
    }[kind]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma": transformers.GemmaForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    }[kind]
    config = config_cls(**{**common, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # Random init leaves norms at 1 and some biases at 0: perturb so that every weight matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from_hf(hf_model, device: str = "cpu", dtype: torch.dtype | None = None):
    config = config_from_hf(hf_model.config.to_dict())
    state = {k: v.detach().clone().to(device=device, dtype=dtype or v.dtype) for k, v in hf_model.state_dict().items()}
    return build_model(config, state), config


def engine_for(model, config: ModelConfig, tokenizer=None, device: str = "cpu", dtype=torch.float32, **engine_kw) -> Engine:
    engine_kw.setdefault("max_batch_total_tokens", 8192)
    loaded = LoadedModel(model, config, tokenizer, torch.device(device), dtype, "test-model")
    return Engine(loaded, EngineConfig(**engine_kw))


def _all_rows_on(adapter: LoraAdapter | None, model, rows: int, encoder_rows: int, device: str, dtype) -> LoraPlan | None:
    """Every row of every kind on `adapter`, from a one-slot table of its own (None: no adapter). The model's
    LoRA wrappers hold no adapter state, so nothing outlives the call."""
    if adapter is None:
        return None
    slots = AdapterTable(model, 1, torch.device(device), dtype)
    slots.install(0, adapter)
    segment = [LoraSegment(0, 0, rows)]
    encoder = [LoraSegment(0, 0, encoder_rows)] if encoder_rows else []
    return LoraPlan(tokens=segment, logits=segment, weights=slots.columns, encoder=encoder, dtype=dtype)


@torch.inference_mode()
def full_logits(
    model, config: ModelConfig, token_ids: list[int], device: str = "cpu", adapter: LoraAdapter | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits at every position of one sequence, through our paged attention path (one prefill step).

    With `adapter`, every row (token rows and logits rows) uses it, from a one-slot table of its own:
    the model's LoRA wrappers hold no adapter state, so nothing outlives the call.
    """
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, 64, 16, torch.device(device), dtype,
                         kv_cache_dtype=kv_cache_dtype)
    request = Request("probe", list(token_ids), SamplingParams(max_new_tokens=1), 0, 0.0)
    request.block_ids = list(range(-(-len(token_ids) // 16)))
    batch = runner.batches.build([ScheduledRequest(request, len(token_ids))])
    lora = _all_rows_on(adapter, model, len(token_ids), 0, device, dtype)
    with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend, lora)):
        hidden = model(batch.input_ids, batch.positions)
        return model.compute_logits(hidden).float()


@torch.inference_mode()
def encoder_decoder_logits(
    model, config: ModelConfig, encoder_ids: list[int], decoder_ids: list[int], adapter: LoraAdapter | None = None,
    device: str = "cpu", kv_cache_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decoder logits at every position of `decoder_ids` given `encoder_ids`, through our engine's path
    (one step: the encoder runs, its cross-attention states are stored, the decoder ids are prefilled).

    With `adapter`, every row of every kind uses it (a one-slot table of its own)."""
    dtype = next(model.parameters()).dtype  # the embedding: the compute dtype (T5 may keep its wo in float32)
    runner = ModelRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, 64, 16, torch.device(device), dtype,
                         kv_cache_dtype=kv_cache_dtype)
    request = Request("probe", list(decoder_ids), SamplingParams(max_new_tokens=1), 0, 0.0, encoder_ids=list(encoder_ids))
    own = -(-len(decoder_ids) // 16)
    request.block_ids = list(range(own))
    request.cross_block_ids = list(range(own, own + -(-len(encoder_ids) // 16)))
    batch = runner.batches.build([ScheduledRequest(request, len(decoder_ids))])
    lora = _all_rows_on(adapter, model, len(decoder_ids), len(encoder_ids), device, dtype)
    with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend, lora)):
        hidden = runner.model_call.forward([ScheduledRequest(request, len(decoder_ids))], batch, lora)
        return model.compute_logits(hidden).float()


def tiny_t5(gated: bool = False, seed: int = 0, vocab_size: int = 300, **overrides):
    """A random transformers T5ForConditionalGeneration: v1.0 (ReLU, tied head) or, `gated`, v1.1
    (gated-GELU), with encoder and decoder of different depths and few position buckets (so inputs longer
    than 20 tokens reach the logarithmic ones). Weights are drawn wide enough that greedy tokens vary,
    norms perturbed so they matter."""
    import transformers

    config = transformers.T5Config(**{
        **dict(vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4,
               feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
               relative_attention_num_buckets=8, relative_attention_max_distance=20),
        **overrides,
    })
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "relative_attention_bias" in name:
                p.normal_(0, 2.0)
            elif p.dim() == 2:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
    return model


_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "translate English to German: the house is wonderful.",
    "summarize: studies have shown that owning a dog is good for you, and the world answers.",
    "A tiny model says hello to the world; numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ! ? : ;",
]


def tiny_seq2seq_tokenizer(kind: str):
    """A real (trained, saved, reloadable) tokenizer for tiny T5 or BART checkpoints: T5's is SentencePiece
    style (Unigram, Metaspace, </s> appended, <pad>=0 </s>=1 <unk>=2); BART's byte-level BPE
    (<s> ... </s>, <s>=0 <pad>=1 </s>=2 <unk>=3)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if kind == "t5":
        # A fixed vocabulary (Unigram training is not deterministic): specials, characters, whole words.
        words = sorted({w for line in _TOKENIZER_TEXT for w in line.split()})
        chars = sorted({c for line in _TOKENIZER_TEXT for c in line if c != " "})
        pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
        pieces += [(c, -5.0) for c in chars] + [("\u2581" + c, -5.5) for c in chars]
        pieces += [("\u2581" + w, -3.0) for w in words]
        tok = Tokenizer(models.Unigram(pieces, unk_id=2))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        return transformers.T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(_TOKENIZER_TEXT * 5, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


@torch.inference_mode()
def hf_seq2seq_greedy(model, encoder_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy tokens for one encoder input, EOS not a stop (decoder start dropped)."""
    out = model.generate(
        torch.tensor([encoder_ids]), do_sample=False, max_new_tokens=max_new_tokens, use_cache=False,
        **{"eos_token_id": None, **kwargs},
    )
    tokens = out[0, 1:].tolist()
    assert len(tokens) == max_new_tokens, f"generate stopped early: {tokens}"
    return tokens


def tiny_mpt(seed: int = 0, **attn):
    """A random transformers MptForCausalLM (ALiBi) whose norms and biases are perturbed so they matter."""
    import transformers

    config = transformers.MptConfig(
        d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=512, vocab_size=49152,
        attn_config={"alibi": True, **attn},
    )
    torch.manual_seed(seed)
    model = transformers.MptForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def load_saved(path) -> tuple[torch.nn.Module, ModelConfig]:
    """Ours from a checkpoint directory as it is on disk (load_ours would save transformers' config first)."""
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    return build_model(config, load_state_dict(source)), config


def greedy_tokens(engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Our greedy tokens for each prompt, all in one batch, EOS not a stop."""
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))]


def load_ours(hf, path) -> tuple[torch.nn.Module, ModelConfig]:
    hf.save_pretrained(path)
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    return build_model(config, load_state_dict(source)), config


def asgi_calls(app, *calls: tuple[str, str, dict | None]) -> list:
    """(method, path, JSON body) calls to an ASGI app, one after the other, in one event loop; a streamed call's
    body is read to its end. The httpx responses."""
    import httpx

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            return [await c.request(method, path, json=body) for method, path, body in calls]

    return asyncio.run(main())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(*args: str, ready_timeout: float = 180) -> Iterator[str]:
    """`loraplex serve` in a subprocess on a free 127.0.0.1 port; yields its URL once it accepts."""
    with live_server_process(*args, ready_timeout=ready_timeout) as (url, _):
        yield url


@contextmanager
def live_server_process(*args: str, ready_timeout: float = 180) -> Iterator[tuple[str, subprocess.Popen]]:
    """As live_server, yielding (URL, the server's process) for tests that read the process itself (its memory).

    The server binds its socket before printing its ready line, so the line is the readiness signal.
    """
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", "--hostname", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    ready = threading.Event()
    log: list[str] = []

    def drain() -> None:  # keep reading so the pipe never fills; flag the ready line
        for line in proc.stdout:
            log.append(line)
            if line.startswith("loraplex ready"):
                ready.set()
        ready.set()  # exited: let the caller fail fast

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(timeout=ready_timeout) and proc.poll() is None, "server did not start:\n" + "".join(log)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@torch.inference_mode()
def image_model_logits(engine, token_ids: list[int], images=None) -> torch.Tensor:
    """Logits at every prompt position of one request with `images` (Mllama: image states), through the
    engine's runner in one prefill step (the image states are made, stored and read in it)."""
    # (Asking for prompt logprobs keeps prefix caching out: every position is computed in this one step.)
    request = engine.add_request(list(token_ids), SamplingParams(max_new_tokens=1, prompt_logprobs=True), images=images)
    scheduled = engine.scheduler.schedule().scheduled
    assert [s.request for s in scheduled] == [request] and scheduled[0].num_new_tokens == len(token_ids)
    runner = engine.runner
    batch = runner.batches.build(scheduled)
    with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend, None)):
        logits = engine.runner.model.compute_logits(runner.model_call.forward(scheduled, batch, None)).float()
    engine.abort_request(request.request_id)
    return logits


def counting_launches(engine) -> dict[str, int]:
    """Counts the engine's launched decode steps (engine/worker/overlap.py), and those chained to a step still in flight."""
    counts = {"launched": 0, "chained": 0}
    launch = engine.runner.launch

    def counted(*args):
        counts["launched"] += 1
        counts["chained"] += args[-1] is not None
        return launch(*args)

    engine.runner.launch = counted
    return counts


def metric_value(metrics_text: str, name: str) -> float:
    """The value of the sample `name` in a /metrics exposition: unlabelled, or labelled only with the served model's
    name (vLLM's series carry `model_name`)."""
    import re

    match = re.search(rf'^{re.escape(name)}(?:\{{model_name="[^"]*"\}})? (\S+)$', metrics_text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
