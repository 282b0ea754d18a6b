"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen2-MoE): a router picks each token's top-k experts, the
experts' gated MLPs run as grouped products over the (token, expert) pairs sorted by expert, and each token sums
its experts' outputs weighted by the router's probabilities.

The experts' weights are stacked, one 3-D tensor per product as transformers 5 holds them: `gate_up_proj`
[E, 2 * intermediate, hidden] (each expert's gate rows, then its up rows) and `down_proj` [E, hidden, intermediate],
so that a grouped kernel reads every expert from one tensor. `grouped_product` is where such a kernel plugs in.

The experts take an optional `ExpertTerms`: terms added to each grouped product's output, pair by pair (the LoRA
layer adds each pair's adapter delta for that pair's expert; lora/step/experts.py). This module knows nothing of
adapters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import triton_available
from loraplex.layers.activation import act_and_mul


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



def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `top_k` experts [T, k] and their weights [T, k], from router logits [T, E], as transformers
    picks them: softmax in float32, `torch.topk` (so ties break as in transformers), the top-k probabilities
    rescaled to sum to 1 when `renormalize`; weights float32 unless `weights_dtype` says otherwise."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_dtype is None else weights.to(weights_dtype)), experts


@dataclass(frozen=True)
class ExpertDispatch:
    """A step's (token row, expert) pairs sorted by expert, stably (within an expert, in row order: rows of one
    adapter, contiguous in the step, stay contiguous within each expert's pairs)."""

    rows: torch.Tensor  # [P] the token row of each pair
    experts: torch.Tensor  # [P] its expert (ascending)
    weights: torch.Tensor  # [P] its routing weight
    counts: torch.Tensor  # [E] int64: pairs per expert

    @classmethod
    def of(cls, top_experts: torch.Tensor, top_weights: torch.Tensor, num_experts: int) -> "ExpertDispatch":
        flat = top_experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = torch.arange(top_experts.shape[0], device=flat.device).repeat_interleave(top_experts.shape[1])
        # scatter_add_, not bincount: bincount reads its input's max on the host, which a CUDA graph cannot capture
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        return cls(rows[order], flat[order], top_weights.reshape(-1)[order], counts)

    @functools.cached_property
    def host_counts(self) -> list[int]:
        """`counts` on the host (one sync, shared by the products of one layer)."""
        return self.counts.tolist()

    def combine(self, out: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Each row's sum over its pairs of weight * output [P, H] -> [T, H], added in the pairs' (experts') order
        as transformers adds them; in the weights' dtype, then the output's."""
        weighted = (out * self.weights[:, None]).to(out.dtype)
        return torch.zeros(num_rows, out.shape[1], dtype=out.dtype, device=out.device).index_add_(0, self.rows, weighted)


def grouped_product(x: torch.Tensor, weight: torch.Tensor, dispatch: ExpertDispatch,
                    fused: bool | None = None) -> torch.Tensor:
    """x [P, in] (pairs sorted by expert) times each pair's expert's weight [E, out, in]: [P, out].

    On CUDA with Triton, one grouped-GEMM launch for every expert (layers/kernels/moe_gemm.py): it reads
    dispatch.counts on the device, so nothing waits for the host and a CUDA graph captures it; float32 too (exact
    float32 products), so that float32 models capture as well. Elsewhere (or `fused=False`), the torch reference:
    one matmul per expert that has pairs, from `dispatch.host_counts` (one host sync per layer)."""
    if fused is None:
        fused = (triton_available(x.device) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                 and weight.dtype == x.dtype and weight.stride(-1) == 1)
    if fused:
        from loraplex.layers.kernels.moe_gemm import grouped_gemm

        return grouped_gemm(x, weight, dispatch.counts)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(dispatch.host_counts):
        if count:
            torch.matmul(x[start:start + count], weight[expert].t(), out=out[start:start + count])
        start += count
    return out


class ExpertTerms(Protocol):
    """Terms added to a grouped product's output (the LoRA layer's per-expert deltas)."""

    def add(self, product: str, x: torch.Tensor, out: torch.Tensor, dispatch: ExpertDispatch) -> torch.Tensor:
        """`out` [P, out] of `product` ("gate_up" or "down", the experts' `PRODUCTS`) for input x [P, in], plus
        the terms of each pair."""
        ...


class MoeExperts(nn.Module):
    """`num_experts` gated MLPs, stacked: down(act(gate(x)) * up(x)) for each (row, expert) pair."""

    # Each grouped product -> the per-expert projections it computes, their outputs side by side in its columns
    # (the names PEFT gives each expert's linears, which adapters target: `experts.3.gate_proj`).
    PRODUCTS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = act

    def projection_shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's `projection`."""
        if projection == "down_proj":
            return self.intermediate_size, self.hidden_size
        return self.hidden_size, self.intermediate_size

    def projection_weight(self, expert: int, projection: str) -> torch.Tensor:
        """One expert's `projection` weight [out, in], a view of the stack."""
        if projection == "down_proj":
            return self.down_proj[expert]
        half = self.PRODUCTS["gate_up"].index(projection)
        return self.gate_up_proj[expert, half * self.intermediate_size:(half + 1) * self.intermediate_size]

    def forward(self, x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
                terms: ExpertTerms | None = None) -> torch.Tensor:
        dispatch = ExpertDispatch.of(top_experts, top_weights, self.num_experts)
        pairs = x.index_select(0, dispatch.rows)
        gate_up = grouped_product(pairs, self.gate_up_proj, dispatch)
        if terms is not None:
            gate_up = terms.add("gate_up", pairs, gate_up, dispatch)
        hidden = act_and_mul(self.act, *gate_up.chunk(2, dim=-1))
        out = grouped_product(hidden, self.down_proj, dispatch)
        if terms is not None:
            out = terms.add("down", hidden, out, dispatch)
        return dispatch.combine(out, x.shape[0])


class SparseMoeBlock(nn.Module):
    """The feed-forward of a sparse layer: the router (`gate`, a linear to one logit per expert), the experts, and
    Qwen2-MoE's shared expert (a dense MLP every row takes, scaled by sigmoid(shared_expert_gate(x)))."""

    def __init__(self, hidden_size: int, moe: MoeSettings, act: Callable[[torch.Tensor], torch.Tensor],
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.weights_in_model_dtype = moe.top_k, moe.renormalize, moe.weights_in_model_dtype
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = MoeExperts(moe.num_experts, hidden_size, moe.intermediate_size, act)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.has_shared_expert = shared_expert is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, experts = route(logits, self.top_k, self.renormalize,
                                 logits.dtype if self.weights_in_model_dtype else None)
        out = self.experts(x, weights, experts)
        if self.has_shared_expert:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
