"""The memory-bandwidth roofline of a decode step: how fast decoding could go if every step only
had to read, once, the bytes it cannot avoid reading, at the device's measured copy bandwidth.

Conventions (printed with the figures by benchmarks/gpu.py):

- Bandwidth: a device-to-device copy of one large tensor (1 GiB on CUDA), timed over several repetitions
  (CUDA events on CUDA, time.perf_counter on CPU); the best repetition is kept. A copy of S bytes reads S and
  writes S: the memory's bandwidth is counted as 2 S / seconds (read + write traffic), the rate the roofline
  uses, since a decode step, nearly all reads, can spend all of it on reads. The copy's read side alone
  (S / seconds, half of it) is printed too, with a pure-read check (a sum over the same tensor) for reference.
- Bytes a decode step must read:
  * weights: every parameter of the model once (a tied embedding / head counted once), except an untied input
    embedding table, of which a step reads only its rows' entries (counted as such);
  * KV cache: 2 (K and V) x layers x KV heads x head_dim x dtype bytes, per context token of every row;
  * adapters: the LoRA A and B matrices (at their own rank, in the compute dtype) of the step's distinct adapters.
- Roofline tokens/s = rows per step x bandwidth / bytes per step. Over a decode whose contexts grow by one token a
  step, bytes are linear in the context, so the roofline of the whole decode is the one at the average context.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from loraplex.models.config import ModelConfig
from loraplex.lora.adapter import LoraAdapter

GiB = 2**30


@dataclass(frozen=True)
class Bandwidth:
    copy_bytes: int  # S: the copy reads S bytes and writes S bytes
    copy_seconds: float  # the best repetition
    sum_seconds: float  # a sum over the copy's source (S bytes read), best repetition
    reps: int
    method: str  # "cuda events" | "perf_counter"

    @property
    def bytes_per_s(self) -> float:
        """The roofline's rate: the copy's read + write traffic, 2 S / seconds."""
        return 2 * self.copy_bytes / self.copy_seconds

    @property
    def read_side_bytes_per_s(self) -> float:
        return self.copy_bytes / self.copy_seconds

    @property
    def sum_read_bytes_per_s(self) -> float:
        return self.copy_bytes / self.sum_seconds

    def describe(self) -> str:
        return (f"{self.bytes_per_s / 1e9:.0f} GB/s = read + write traffic of a {self.copy_bytes / GiB:.2f} GiB "
                f"device copy (its read side alone {self.read_side_bytes_per_s / 1e9:.0f} GB/s; a pure-read sum "
                f"{self.sum_read_bytes_per_s / 1e9:.0f} GB/s), best of {self.reps}, {self.method}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"bytes_per_s": self.bytes_per_s,
                                           "read_side_bytes_per_s": self.read_side_bytes_per_s,
                                           "sum_read_bytes_per_s": self.sum_read_bytes_per_s}


def _best_seconds(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - started)
    return best


def copy_bandwidth(device: torch.device, size_bytes: int | None = None, reps: int = 10) -> Bandwidth:
    """Measured memory bandwidth of `device` (see the module's docstring). `size_bytes` defaults to 1 GiB on CUDA,
    64 MiB on CPU."""
    size = size_bytes or (GiB if device.type == "cuda" else 64 * 2**20)
    src = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, reps)
    sum_s = _best_seconds(lambda: src.sum(), device, reps)
    nbytes = src.numel() * src.element_size()
    del src, dst
    return Bandwidth(nbytes, copy_s, sum_s, reps, "cuda events" if device.type == "cuda" else "perf_counter")


def weight_bytes_per_step(model: torch.nn.Module, config: ModelConfig, rows: int) -> int:
    """Parameter bytes a decode step of `rows` rows reads (each tensor once; an untied input embedding: its rows)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.endswith("embed_tokens.weight") and not config.tie_word_embeddings:
            total += min(rows, p.shape[0]) * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def adapter_bytes(adapter: LoraAdapter, dtype: torch.dtype) -> int:
    """An adapter's A and B matrices at their own rank, in the compute dtype (loraplex keeps them in float32 on
    the host and casts them when it installs them in a device slot)."""
    return sum((w.a.numel() + w.b.numel()) * dtype.itemsize for w in adapter.modules.values())


@dataclass(frozen=True)
class DecodeBytes:
    weights: int
    kv: int
    adapters: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.adapters


def decode_step_bytes(
    model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype, rows: int, context_tokens: float,
    adapters: list[LoraAdapter] = (),
) -> DecodeBytes:
    """Bytes one decode step of `rows` rows reads, `context_tokens` being the sum of the rows' context lengths
    (tokens whose K and V the step's attention reads, its own included) and `adapters` the step's distinct ones."""
    return DecodeBytes(
        weight_bytes_per_step(model, config, rows),
        int(kv_bytes_per_token(config, dtype) * context_tokens),
        sum(adapter_bytes(a, dtype) for a in adapters),
    )


def roofline_tokens_per_s(rows: int, step_bytes: DecodeBytes, bandwidth: Bandwidth) -> float:
    return rows * bandwidth.bytes_per_s / step_bytes.total


def average_decode_context(prompt_len: int, new_tokens: int) -> float:
    """Average context of one row over its decode steps: step j (1..new_tokens-1) reads prompt_len + j tokens."""
    return prompt_len + new_tokens / 2 if new_tokens > 1 else float(prompt_len)
