"""Merge several LoRA adapters into one, exactly as PEFT's `LoraModel.add_weighted_adapter` does (PEFT >= 0.22).

Supported strategies (PEFT's `combination_type`): "linear", "cat", "ties", "dare_linear", "dare_ties" and
"magnitude_prune". All of them merge the A and the B matrices separately (never the products B @ A). What
PEFT does, and we reproduce:

* Ranks. "cat" stacks the adapters' factors, so the result's rank is the sum of the inputs' ranks (which
  may differ). Every other strategy needs all adapters to have the same rank, read as PEFT reads it: `r`,
  or the largest of `r` and the `rank_pattern` values; the result keeps it. Adapters that share a module
  must then also have the same rank on it (PEFT fails there).
* Scale. Each source adapter's own scale (alpha / r, or alpha / sqrt(r) with rsLoRA, per module) is folded
  into the merged factors, so the result has `r = lora_alpha`, no patterns and no rsLoRA: its scale is 1
  on every module. (Before 0.22 PEFT copied the first adapter's rsLoRA flag and scaled a second time.)
* Config. Everything else comes from the *first* adapter's config (layers_to_transform, layers_pattern,
  exclude_modules); target_modules is the union of all of them (regexes are joined with "|"; a mix of
  regex and list is refused, as PEFT does). So a module an adapter covers can be dropped when the first
  adapter's layers_to_transform / exclude_modules leave it out.
* Modules. Each module of the result merges only the adapters that have it. A "cat" module holds only
  the factors of those adapters: PEFT pads them with zero rows up to the summed rank, which adds nothing.
* Weights. Adapter i's A is multiplied by `sign * sqrt(|w_i * scale_i|)` and its B by
  `sqrt(|w_i * scale_i|)`, so B @ A picks up `w_i * scale_i` (negative weights subtract); "cat" puts
  all of `w_i * scale_i` on A.
* ties: keep each tensor's `density` fraction of largest magnitudes, elect a sign per entry (sum of
  the unweighted values for "total", count of signs for "frequency"), then average the weighted
  values that agree with it. magnitude_prune: the same trim, then a plain weighted sum. dare_*: keep
  each entry with probability `density`, divide by `density`, then sum (dare_linear) or elect and
  average as ties does (dare_ties). density 1 prunes nothing.
* A single adapter is always merged linearly, whatever the strategy.

DARE is random. For PEFT's numbers to be reproducible, random masks are drawn from `generator` in
PEFT's order: module by module in the base model's order (see `module_order_key`), and within a
module every adapter's A, then every adapter's B.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch

from loraplex.lora.adapter import AdapterInvalid, LoraAdapter, LoraConfig, LoraWeights, check_weights

MERGE_STRATEGIES = ("linear", "cat", "ties", "dare_linear", "dare_ties", "magnitude_prune")
MAJORITY_SIGN_METHODS = ("total", "frequency")

_PRUNED = ("ties", "dare_linear", "dare_ties", "magnitude_prune")
_SIGN_ELECTED = ("ties", "dare_ties")
_RANDOM = ("dare_linear", "dare_ties")
# Linears in the order a Llama-family decoder layer registers them (so named_modules() yields them).
_LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def merge_adapters(
    adapter_id: str,
    adapters: Sequence[LoraAdapter],
    weights: Sequence[float],
    strategy: str = "linear",
    density: float = 1.0,
    majority_sign_method: str = "total",
    generator: torch.Generator | None = None,
) -> LoraAdapter:
    """The adapter PEFT's `add_weighted_adapter(adapters, weights, combination_type=strategy, ...)` builds.

    `generator` feeds DARE's random masks; None uses a fresh one seeded 0, so a merge is reproducible.
    Raises AdapterInvalid for arguments PEFT would refuse or fail on, and for ones it would ignore.
    """
    _check_arguments(adapters, weights, strategy, density, majority_sign_method)
    if len(adapters) == 1:
        strategy = "linear"  # PEFT's rule: one adapter is only ever scaled
    rank = sum(_rank(a) for a in adapters) if strategy == "cat" else _common_rank(adapters, strategy)
    config = _merged_config(adapters, rank)
    if generator is None:
        generator = torch.Generator(_device(adapters)).manual_seed(0)

    covered = {module for adapter in adapters for module in adapter.modules if config.targets(module)}
    modules: dict[str, LoraWeights] = {}
    with torch.no_grad():
        for module in sorted(covered, key=module_order_key):
            present = [(adapter, w) for adapter, w in zip(adapters, weights) if module in adapter.modules]
            if strategy == "cat":
                a, b = _concatenate_module(module, present)
            else:
                _check_module_ranks(module, [adapter for adapter, _ in present])
                a, b = _merge_module(module, present, strategy, density, majority_sign_method, generator)
            modules[module] = LoraWeights(a, b, config.scale(module))
            check_weights(f"the merge's {module}", modules[module])  # weights can push finite inputs past the bounds
    return LoraAdapter(adapter_id, modules, config).packed()


def module_order_key(module: str) -> tuple[float, int, str]:
    """Sort key putting Llama-family module names in `named_modules()` order.

    By layer index (numerically: 2 before 10), then q, k, v, o, gate, up, down within a layer; names
    outside the layers (lm_head) come last. Only DARE's draws depend on it (to match PEFT's numbers).
    """
    match = _LAYER_INDEX.search(module)
    layer = int(match[1]) if match else math.inf
    leaf = module.rsplit(".", 1)[-1]
    position = _LAYER_LINEARS.index(leaf) if leaf in _LAYER_LINEARS else len(_LAYER_LINEARS)
    return layer, position, module


# ---- checks ----------------------------------------------------------------------------------------


def _check_arguments(
    adapters: Sequence[LoraAdapter], weights: Sequence[float], strategy: str, density: float, sign_method: str
) -> None:
    if strategy not in MERGE_STRATEGIES:
        raise AdapterInvalid(f"unknown merge strategy {strategy!r}; expected one of {', '.join(MERGE_STRATEGIES)}")
    if not adapters:
        raise AdapterInvalid("nothing to merge: the list of adapters is empty")
    if len(weights) != len(adapters):
        raise AdapterInvalid(f"got {len(weights)} weights for {len(adapters)} adapters; give one weight per adapter")
    for adapter, weight in zip(adapters, weights):
        if not math.isfinite(weight):
            raise AdapterInvalid(f"the weight of adapter {adapter.adapter_id!r} is {weight!r}; expected a finite number")
        if adapter.config.target_parameters:  # its modules' names are not what its config's patterns match
            raise AdapterInvalid(f"adapter {adapter.adapter_id!r} uses target_parameters: merging such adapters is not "
                                 f"served")
    # `not (0 < d <= 1)` also refuses NaN.
    if strategy in _PRUNED and not 0 < density <= 1:
        raise AdapterInvalid(f"density must be in (0, 1] for strategy {strategy!r}; got {density!r}")
    if sign_method not in MAJORITY_SIGN_METHODS:
        raise AdapterInvalid(
            f"unknown majority_sign_method {sign_method!r}; expected one of {', '.join(MAJORITY_SIGN_METHODS)}"
        )


def _common_rank(adapters: Sequence[LoraAdapter], strategy: str) -> int:
    """The rank all adapters share, as PEFT reads it (largest of r and rank_pattern), or refuse."""
    ranks = {a.adapter_id: _rank(a) for a in adapters}
    if len(set(ranks.values())) > 1:
        listed = ", ".join(f"{name!r} has rank {rank}" for name, rank in ranks.items())
        raise AdapterInvalid(f"merge strategy {strategy!r} needs adapters of equal rank; {listed}")
    return next(iter(ranks.values()))


def _rank(adapter: LoraAdapter) -> int:
    return max([adapter.config.r, *adapter.config.rank_pattern.values()])


def _check_module_ranks(module: str, adapters: Sequence[LoraAdapter]) -> None:
    # rank_pattern can give one module different ranks in adapters whose overall ranks agree.
    ranks = {adapter.adapter_id: adapter.modules[module].rank for adapter in adapters}
    if len(set(ranks.values())) > 1:
        listed = ", ".join(f"{name!r} has rank {rank}" for name, rank in ranks.items())
        raise AdapterInvalid(f"cannot merge module {module}: its LoRA ranks differ ({listed})")


# ---- the merged config -----------------------------------------------------------------------------


def _merged_config(adapters: Sequence[LoraAdapter], rank: int) -> LoraConfig:
    """The first adapter's config with the union of targets, r = alpha = rank, no patterns, no rsLoRA: scale 1."""
    first = adapters[0].config
    return LoraConfig(
        r=rank,
        lora_alpha=float(rank),
        use_rslora=False,
        target_modules=_merged_targets(adapters),
        layers_to_transform=first.layers_to_transform,
        layers_pattern=first.layers_pattern,
        exclude_modules=first.exclude_modules,
    )


def _merged_targets(adapters: Sequence[LoraAdapter]) -> tuple[str, ...] | str:
    targets = [adapter.config.target_modules for adapter in adapters]
    regexes = [isinstance(t, str) for t in targets]
    if all(regexes):
        return "|".join(f"({t})" for t in targets)
    if any(regexes):
        kinds = ", ".join(f"{a.adapter_id!r}: {'regex' if r else 'list'}" for a, r in zip(adapters, regexes))
        raise AdapterInvalid(f"cannot merge adapters whose target_modules mix a regex and a list ({kinds})")
    return tuple(sorted(set().union(*targets)))


# ---- the arithmetic --------------------------------------------------------------------------------


def _merge_module(
    module: str,
    present: Sequence[tuple[LoraAdapter, float]],
    strategy: str,
    density: float,
    sign_method: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (A, B) of one module from the adapters that have it; A is merged (and drawn for) first."""
    factors_a, factors_b = [], []
    for adapter, weight in present:
        weighted_scale = weight * adapter.modules[module].scale
        magnitude = math.sqrt(abs(weighted_scale))
        # The sign goes on A only: on both sides it would cancel out in B @ A.
        factors_a.append(magnitude if weighted_scale >= 0 else -magnitude)
        factors_b.append(magnitude)
    first_a = present[0][0].modules[module].a
    merged = []
    for part, factors in (("a", factors_a), ("b", factors_b)):
        tensors = [getattr(adapter.modules[module], part) for adapter, _ in present]
        factors_t = torch.tensor(factors, device=first_a.device)
        merged.append(_merge_tensors(tensors, factors_t, strategy, density, sign_method, generator).to(first_a.dtype))
    return merged[0], merged[1]


def _concatenate_module(module: str, present: Sequence[tuple[LoraAdapter, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapters' factors stacked along the rank, each A carrying its adapter's weight and scale."""
    dtype = present[0][0].modules[module].a.dtype
    parts = [adapter.modules[module] for adapter, _ in present]
    a = torch.cat([part.a.float() * (weight * part.scale) for part, (_, weight) in zip(parts, present)], dim=0)
    b = torch.cat([part.b.float() for part in parts], dim=1)
    return a.to(dtype), b.to(dtype)


def _merge_tensors(
    tensors: Sequence[torch.Tensor],
    factors: torch.Tensor,
    strategy: str,
    density: float,
    sign_method: str,
    generator: torch.Generator,
) -> torch.Tensor:
    if strategy in _PRUNED and density < 1:
        prune = _drop_at_random if strategy in _RANDOM else _keep_largest
        tensors = [prune(t, density, generator) for t in tensors]
    stacked = torch.stack(list(tensors))
    weighted = stacked * factors.view(-1, *([1] * (stacked.dim() - 1)))
    if strategy not in _SIGN_ELECTED:
        return weighted.sum(dim=0)
    agrees = _agrees_with_majority_sign(stacked, sign_method)
    # Average over the adapters that agree (at least 1, so entries nobody kept stay 0).
    return (weighted * agrees).sum(dim=0) / agrees.sum(dim=0).clamp(min=1.0)


def _keep_largest(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Zero all but the int(density * numel) entries of largest magnitude (TIES' trim step)."""
    keep = torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    keep[tensor.abs().flatten().topk(int(density * tensor.numel())).indices] = 1
    return tensor * keep.view_as(tensor)


def _drop_at_random(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Keep each entry with probability density, rescaled by 1/density to keep its expectation (DARE)."""
    keep = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * keep / density


def _agrees_with_majority_sign(stacked: torch.Tensor, method: str) -> torch.Tensor:
    """Per adapter and entry: does its (unweighted) sign match the elected one? Ties elect +."""
    signs = stacked.sign()
    votes = stacked.sum(dim=0) if method == "total" else signs.sum(dim=0)
    elected = torch.where(votes >= 0, 1.0, -1.0)
    return signs == elected


def _device(adapters: Sequence[LoraAdapter]) -> torch.device:
    first = next(iter(adapters[0].modules.values()), None)
    return first.a.device if first is not None else torch.device("cpu")
