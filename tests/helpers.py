"""Shared test helpers: tiny random models with a transformers twin, and a direct logits probe."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from loraplex.config import EngineConfig, ModelConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel, build_model
from loraplex.engine.request import Request
from loraplex.engine.runner import ModelRunner
from loraplex.engine.scheduler import ScheduledRequest
from loraplex.layers.forward_context import ForwardContext, LoraRows, LoraSegment, forward_context
from loraplex.lora.adapter import LoraAdapter
from loraplex.lora.layers import LoraSlots
from loraplex.params import SamplingParams
from loraplex.weights import load_state_dict, resolve_model


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
    }[kind]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
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
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    state = {k: v.detach().clone().to(device=device, dtype=dtype or v.dtype) for k, v in hf_model.state_dict().items()}
    return build_model(config, state), config


def engine_for(model, config: ModelConfig, tokenizer=None, device: str = "cpu", dtype=torch.float32, **engine_kw) -> Engine:
    engine_kw.setdefault("max_batch_total_tokens", 8192)
    loaded = LoadedModel(model, config, tokenizer, torch.device(device), dtype, "test-model")
    return Engine(loaded, EngineConfig(**engine_kw))


@torch.inference_mode()
def full_logits(
    model, config: ModelConfig, token_ids: list[int], device: str = "cpu", adapter: LoraAdapter | None = None
) -> torch.Tensor:
    """Logits at every position of one sequence, through our paged attention path (one prefill step).

    With `adapter`, every row (token rows and logits rows) uses it, from a one-slot table of its own:
    the model's LoRA wrappers hold no adapter state, so nothing outlives the call.
    """
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, 64, 16, torch.device(device), dtype)
    request = Request("probe", list(token_ids), SamplingParams(max_new_tokens=1), 0, 0.0)
    request.block_ids = list(range(-(-len(token_ids) // 16)))
    batch = runner._build_batch([ScheduledRequest(request, len(token_ids))])
    lora = None
    if adapter is not None:
        slots = LoraSlots(model, 1, torch.device(device), dtype)
        slots.install(0, adapter)
        rows = [LoraSegment(0, 0, len(token_ids))]
        lora = LoraRows(tokens=rows, logits=rows, weights=slots.tables)
    with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend, lora)):
        hidden = model(batch.input_ids, batch.positions)
        return model.compute_logits(hidden).float()


@torch.inference_mode()
def encoder_decoder_logits(
    model, config: ModelConfig, encoder_ids: list[int], decoder_ids: list[int], adapter: LoraAdapter | None = None
) -> torch.Tensor:
    """Decoder logits at every position of `decoder_ids` given `encoder_ids`, through our engine's path
    (one step: the encoder runs, its cross-attention states are stored, the decoder ids are prefilled).

    With `adapter`, every row of every kind uses it (a one-slot table of its own)."""
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, 64, 16, torch.device("cpu"), dtype)
    request = Request("probe", list(decoder_ids), SamplingParams(max_new_tokens=1), 0, 0.0, encoder_ids=list(encoder_ids))
    own = -(-len(decoder_ids) // 16)
    request.block_ids = list(range(own))
    request.cross_block_ids = list(range(own, own + -(-len(encoder_ids) // 16)))
    batch = runner._build_batch([ScheduledRequest(request, len(decoder_ids))])
    lora = None
    if adapter is not None:
        slots = LoraSlots(model, 1, torch.device("cpu"), dtype)
        slots.install(0, adapter)
        rows = [LoraSegment(0, 0, len(decoder_ids))]
        lora = LoraRows(tokens=rows, logits=rows, weights=slots.tables, encoder=[LoraSegment(0, 0, len(encoder_ids))])
    with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend, lora)):
        hidden = runner._forward([ScheduledRequest(request, len(decoder_ids))], batch, lora)
        return model.compute_logits(hidden).float()


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


def load_ours(hf, path) -> tuple[torch.nn.Module, ModelConfig]:
    hf.save_pretrained(path)
    source = resolve_model(path)
    config = ModelConfig.from_hf(source.hf_config)
    return build_model(config, load_state_dict(source)), config


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(*args: str, ready_timeout: float = 180) -> Iterator[str]:
    """`loraplex serve` in a subprocess on a free 127.0.0.1 port; yields its URL once it accepts.

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
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
