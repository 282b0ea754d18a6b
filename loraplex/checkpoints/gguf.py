"""GGUF (llama architecture) -> an HF-format directory, dequantised once and cached.

The converted directory (config.json, float32 model.safetensors, tokenizer files) lives under loraplex's
cache dir, keyed by the GGUF file's size, mtime and the converter version, built as every cache entry is
(cache.py `build_cached_dir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import time
import warnings
from typing import Any, Callable

import torch

from loraplex.checkpoints.cache import build_cached_dir, cache_dir, print_to_stderr
from loraplex.checkpoints.weights import WeightsError, _few

# Bump whenever the converted output changes: it is part of the GGUF cache key.
GGUF_CONVERTER_VERSION = "1"


# --------------------------------------------------------------------------------------------------
# GGUF -> HF directory

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry nothing our Llama needs. rope_freqs holds per-frequency rope factors computed from
# the rope scaling (Llama 3.1 style); it is accepted only when it is all ones (no scaling), see below.
_GGUF_IGNORABLE = {"rope_freqs.weight"}


def gguf_cache_path(gguf_file: str | os.PathLike) -> pathlib.Path:
    """Where the converted copy of `gguf_file` lives: keyed by file size, mtime and converter version."""
    path = pathlib.Path(gguf_file)
    st = path.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{GGUF_CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def convert_gguf(gguf_file: str | os.PathLike, progress: Callable[[str], None] = print_to_stderr) -> pathlib.Path:
    """Convert a llama-architecture GGUF file to an HF directory (cached); return the directory."""
    src = pathlib.Path(gguf_file).expanduser().resolve()
    if not src.is_file():
        raise WeightsError(f"{gguf_file}: no such GGUF file")
    return build_cached_dir(gguf_cache_path(src), lambda tmp: _convert_gguf_into(src, tmp, progress))


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's rotary permutation of q/k rows (it reorders each head's rows from halves to pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_gguf_into(src: pathlib.Path, out: pathlib.Path, progress: Callable[[str], None]) -> None:
    import gguf
    import numpy as np
    from gguf import quants
    from safetensors.torch import save_file

    started = time.perf_counter()
    progress(f"converting GGUF {src.name} to safetensors (once; cached in {out.parent})")
    reader = gguf.GGUFReader(str(src))
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise WeightsError(f"{src.name}: GGUF architecture {arch!r} is not supported (supported: llama)")

    def need(key: str) -> Any:
        value = _meta(reader, f"llama.{key}")
        if value is None:
            raise WeightsError(f"{src.name}: GGUF metadata lacks llama.{key}")
        return value

    n_layers, hidden = int(need("block_count")), int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_head_kv = int(_meta(reader, "llama.attention.head_count_kv", n_head))
    head_dim = int(_meta(reader, "llama.attention.key_length", hidden // n_head))
    rope_dim = int(_meta(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise WeightsError(f"{src.name}: partial rotary (rope dims {rope_dim} of head dim {head_dim}) is not supported")

    tensors: dict[str, Any] = {}
    unknown: list[str] = []
    total = len(reader.tensors)
    every = max(1, -(-total // 8))
    for i, t in enumerate(reader.tensors, 1):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        data = np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if not data.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            data = data.copy()
        if t.name in _GGUF_IGNORABLE:
            if t.name == "rope_freqs.weight" and not np.allclose(data, 1.0):
                raise WeightsError(
                    f"{src.name}: rope_freqs carries rope scaling factors (Llama 3.1 style) that loraplex "
                    "cannot recover from GGUF; use the HF checkpoint of this model instead"
                )
        elif t.name in _GGUF_GLOBAL_NAMES:
            tensors[_GGUF_GLOBAL_NAMES[t.name]] = data
        elif (m := _GGUF_BLOCK_RE.fullmatch(t.name)) and m.group(2) in _GGUF_BLOCK_NAMES:
            layer, part, kind = m.groups()
            if part == "attn_q":
                data = _unpermute(data, n_head)
            elif part == "attn_k":
                data = _unpermute(data, n_head_kv)
            tensors[f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{kind}"] = data
        else:
            unknown.append(t.name)
        if i % every == 0 or i == total:
            progress(f"converting GGUF {src.name}: {i}/{total} tensors")
    if unknown:
        raise WeightsError(f"{src.name}: GGUF tensors loraplex does not know how to map: {_few(sorted(unknown))}")
    if "model.embed_tokens.weight" not in tensors:
        raise WeightsError(f"{src.name}: GGUF has no token_embd.weight")

    config = _gguf_hf_config(reader, src, tensors, n_layers, hidden, n_head, n_head_kv, head_dim)
    weights = {name: torch.from_numpy(array) for name, array in tensors.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights
    del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_gguf_tokenizer(reader, src, out, progress)
    progress(f"converted GGUF {src.name} in {time.perf_counter() - started:.1f} s")


def _gguf_hf_config(
    reader: Any, src: pathlib.Path, tensors: dict[str, Any], n_layers: int, hidden: int,
    n_head: int, n_head_kv: int, head_dim: int,
) -> dict[str, Any]:
    embed = tensors["model.embed_tokens.weight"]
    intermediate = _meta(reader, "llama.feed_forward_length")
    if intermediate is None:
        intermediate = tensors["model.layers.0.mlp.up_proj.weight"].shape[0]
    rope_theta = float(_meta(reader, "llama.rope.freq_base", 10000.0))
    rope_parameters: dict[str, Any] = {"rope_theta": rope_theta, "rope_type": "default"}
    scaling = _meta(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise WeightsError(f"{src.name}: rope scaling {scaling!r} is not supported (supported: linear)")
        rope_parameters.update(rope_type="linear", factor=float(_meta(reader, "llama.rope.scaling.factor", 1.0)))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(embed.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(intermediate),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_meta(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": int(_meta(reader, "llama.context_length", 4096)),
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in tensors,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "torch_dtype": "float32",
        "dtype": "float32",  # the transformers >= 5 spelling of torch_dtype
    }
    if rope_parameters["rope_type"] == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": rope_parameters["factor"]}
    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    pad = _meta(reader, "tokenizer.ggml.padding_token_id")
    eos_ids = [int(x) for x in (eos, _meta(reader, "tokenizer.ggml.eot_token_id")) if x is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config


def _save_gguf_tokenizer(reader: Any, src: pathlib.Path, out: pathlib.Path, progress: Callable[[str], None]) -> None:
    if "tokenizer.ggml.model" not in reader.fields or "tokenizer.ggml.tokens" not in reader.fields:
        warnings.warn(f"{src.name}: GGUF has no tokenizer metadata; the converted model has no tokenizer", stacklevel=3)
        return
    from transformers import AutoTokenizer

    progress(f"converting GGUF {src.name}: tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    template = _meta(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
