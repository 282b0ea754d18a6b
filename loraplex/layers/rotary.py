"""Rotary position embeddings (rotate-half layout), with linear, Llama 3, YaRN, dynamic NTK and LongRoPE frequency
scaling, over each head's first dims only where the model says so (partial rotary).

Dynamic NTK and LongRoPE frequencies depend on how long a row's sequence is: each row gets those of its own sequence
at this step (its last position in the step + 1, from the forward context), which is what transformers computes for
that sequence run alone with a KV cache. Keys already cached keep the rotation they were written with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from loraplex.layers.forward_context import get_forward_context
from loraplex.layers.kernels import fused_kernels_wanted

SCALED_BY_LENGTH = ("dynamic", "longrope")


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



def inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """The frequencies of `dim` rotary dims; for dynamic and LongRoPE those of sequences within the original context."""
    exponents = _exponents(dim)
    if rope.kind == "longrope":
        return _longrope_frequencies(rope, exponents, rope.short_factor)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn_scaled(inv_freq, rope, dim)
    return inv_freq


def _exponents(dim: int) -> torch.Tensor:
    # Explicitly on the CPU: models are built under torch.device("meta"), and this is no weight.
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _longrope_frequencies(rope: RopeConfig, exponents: torch.Tensor, factors: tuple[float, ...]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=exponents.device) * rope.theta**exponents)


def _dynamic_ntk_frequencies(rope: RopeConfig, dim: int, exponents: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[T, dim / 2]: NTK-aware scaling, the base raised with each row's sequence length (the original context's
    frequencies up to it), in float32 as transformers computes it."""
    context = rope.original_max_position_embeddings
    lengths = seq_lens.clamp(min=context).float()
    base = rope.theta * (rope.factor * lengths / context - (rope.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base[:, None] ** exponents[None, :]


def _yarn_scaled(inv_freq: torch.Tensor, rope: RopeConfig, dim: int) -> torch.Tensor:
    # Dimensions that turn more than beta_fast times over the original context keep their frequency, those that
    # turn fewer than beta_slow times are slowed by `factor`, and a linear ramp blends the band between.
    def dimension_turning(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_turning(rope.beta_fast), dimension_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin), each [T, 1, R]: computed once per forward, shared by every layer. R is the rotary
    width: the head's, or its first int(head_dim * partial_rotary_factor) dims (apply_rotary passes the rest)."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.dim = rope, rope.rotary_dim(head_dim)
        # Plain attributes, not buffers: derived from the config, never loaded, and they must survive building the
        # model on the meta device. They follow the inputs' device on first use.
        self.inv_freq = inverse_frequencies(rope, self.dim)
        self.by_length = rope.kind in SCALED_BY_LENGTH
        if rope.kind == "dynamic":
            self.exponents = _exponents(self.dim)
        elif rope.kind == "longrope":
            self.long_inv_freq = _longrope_frequencies(rope, _exponents(self.dim), rope.long_factor)
        self.attention_factor = rope.attention_factor

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`seq_lens` [T]: each row's sequence length at this step, read by dynamic and LongRoPE scaling; by default
        the step's (forward context)."""
        if self.inv_freq.device != positions.device:
            self._follow(positions.device)
        inv_freq = self._row_frequencies(positions, seq_lens) if self.by_length else self.inv_freq[None, :]
        # Angles in float32 whatever the model dtype, as the reference computes them.
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _row_frequencies(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor:
        """[T, R / 2]: each row's frequencies, the scaled ones where its sequence is longer than the original context.
        Both sets are computed and each row picks one on the device: no host sync, no branch on values (CUDA graphs)."""
        if seq_lens is None:
            seq_lens = get_forward_context().attn_metadata.row_seq_lens(positions)
        if self.rope.kind == "longrope":
            scaled = self.long_inv_freq[None, :]
        else:
            scaled = _dynamic_ntk_frequencies(self.rope, self.dim, self.exponents, seq_lens)
        past = (seq_lens > self.rope.original_max_position_embeddings)[:, None]
        return torch.where(past, scaled, self.inv_freq[None, :])

    def _follow(self, device: torch.device) -> None:
        for name in ("inv_freq", "exponents", "long_inv_freq"):
            if hasattr(self, name):
                setattr(self, name, getattr(self, name).to(device))


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] rotated by their positions' angles: their first R dims (cos, sin [T, 1, R]); where
    R < D (partial rotary) the rest pass through, as transformers' Phi-3 attention does."""
    cos, sin = cos_sin
    if cos.shape[-1] < q.shape[-1]:
        # The fused kernel rotates whole heads: partial rotary takes the torch ops, eager and in CUDA graphs alike.
        return _rotated_part(q, cos, sin), _rotated_part(k, cos, sin)
    if fused_kernels_wanted(q.device) and q.stride(-1) == 1 and k.stride(-1) == 1:
        from loraplex.layers.kernels.elementwise import rotary

        heads = q.shape[1]
        if _adjacent_heads(q, k):  # q's and k's heads side by side in one fused projection: one launch for both
            both = rotary(q.as_strided((q.shape[0], heads + k.shape[1], q.shape[2]), q.stride()), cos, sin)
            return both[:, :heads], both[:, heads:]
        return rotary(q, cos, sin), rotary(k, cos, sin)  # one kernel each, the same rounding as below
    return _rotated(q, cos, sin), _rotated(k, cos, sin)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotated_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    width = cos.shape[-1]
    return torch.cat((_rotated(x[..., :width], cos, sin), x[..., width:]), dim=-1)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q and k are views of one [T, H + Hkv, D] tensor, q's heads then k's (one fused projection's output).
    Adjacent addresses are not enough: two allocations can happen to touch (a quantized layer's separate q and k
    outputs), and a view over both would write across an allocation we do not own. So the storage must be one and
    the combined view must lie inside it. (A single row's stride carries no meaning, and views give q's and k's
    different ones.)"""
    rows, heads, dim = q.shape
    if not (rows == k.shape[0] and (rows == 1 or q.stride(0) == k.stride(0)) and dim == k.shape[2]
            and q.stride()[1:] == k.stride()[1:] == (dim, 1)
            and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()):
        return False
    storage = q.untyped_storage()
    if storage.data_ptr() != k.untyped_storage().data_ptr():
        return False
    last = q.storage_offset() + (rows - 1) * q.stride(0) + (heads + k.shape[1]) * dim  # one past the view's end
    return last * q.element_size() <= storage.nbytes()
