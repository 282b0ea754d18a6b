"""Deterministic benchmark workloads: seeded random prompts of exact lengths, and per-request output lengths."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]  # per request; every one is generated (EOS ignored)
    seed: int = 0
    adapter_ids: list[str] | None = None  # per request (None: every request on the base model)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def new_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def select(self, indices: Iterable[int]) -> Workload:
        indices = list(indices)
        prompts, outputs = [self.prompts[i] for i in indices], [self.max_new_tokens[i] for i in indices]
        adapters = None if self.adapter_ids is None else [self.adapter_ids[i] for i in indices]
        return Workload(self.name, prompts, outputs, self.seed, adapters)

    def head(self, n: int) -> Workload:
        return self.select(range(min(n, self.num_requests)))

    @property
    def num_adapters(self) -> int:
        return len(set(self.adapter_ids or ()))

    def describe(self) -> str:
        """'32 requests x 128 prompt / 32 new tokens', or with ranges '... x 17..250 prompt / 8..63 ... (seed 0)';
        with adapters '..., round-robin over 8 adapters'."""
        prompt_lens = [len(p) for p in self.prompts]
        text = f"{self.num_requests} requests x {_span(prompt_lens)} prompt / {_span(self.max_new_tokens)} new tokens"
        if self.adapter_ids is not None:
            text += f", round-robin over {self.num_adapters} adapters"
        uniform = len(set(prompt_lens)) == 1 and len(set(self.max_new_tokens)) == 1
        return text if uniform else f"{text} (seed {self.seed})"


def _span(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def random_prompts(
    lengths: Sequence[int], vocab_size: int, special_ids: Iterable[int], rng: random.Random
) -> list[list[int]]:
    """Prompts of exactly `lengths` tokens, ids drawn uniformly from the vocabulary minus the special ids."""
    special = set(special_ids)
    allowed = [i for i in range(vocab_size) if i not in special]
    return [rng.choices(allowed, k=n) for n in lengths]


def equal_workload(
    num_requests: int, vocab_size: int, special_ids: Iterable[int] = (), prompt_len: int = 128, new_tokens: int = 32,
    seed: int = 0, name: str = "equal",
) -> Workload:
    rng = random.Random(seed)
    prompts = random_prompts([prompt_len] * num_requests, vocab_size, special_ids, rng)
    return Workload(name, prompts, [new_tokens] * num_requests, seed)


def mixed_workload(
    num_requests: int, vocab_size: int, special_ids: Iterable[int] = (), prompt_lens: tuple[int, int] = (16, 256),
    new_tokens: tuple[int, int] = (8, 64), seed: int = 0, name: str = "mixed",
) -> Workload:
    """Prompt and output lengths drawn uniformly (inclusive ranges) from `seed`."""
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_lens) for _ in range(num_requests)]
    outputs = [rng.randint(*new_tokens) for _ in range(num_requests)]
    return Workload(name, random_prompts(lengths, vocab_size, special_ids, rng), outputs, seed)


def round_robin(workload: Workload, adapter_ids: Sequence[str], name: str | None = None) -> Workload:
    """The workload with request i on adapter_ids[i % len(adapter_ids)]."""
    ids = [adapter_ids[i % len(adapter_ids)] for i in range(workload.num_requests)]
    return Workload(name or workload.name, workload.prompts, workload.max_new_tokens, workload.seed, ids)
