"""Start-up warm-up: made-up requests run through the engine's own steps before the first real one, so that the
work a process does once lands before serving rather than in its first users' requests: Triton compiles the
kernels (or loads them from its disk cache) for the shapes the steps take, the attention paths probe what the
device supports (layers/kernels/varlen_prefill.py), and the decode graphs are captured at every batch size, over
an adapter and without (engine/worker/decode_graphs.py). TGI and LoRAX warm up likewise.

The requests: two long prompts, over two made-up adapters (with one adapter slot only: over the one and without),
together longer than a step's prompt budget (so one is chunked and resumed over its cached context): a step of
several adapters' rows takes the tile kernels (lora/step/kernels/sgmv.py), which would otherwise compile in the
first step that mixes adapters, stalling every request in it. Then, at every graph batch size, that many short
prompts decoding a few tokens, over the adapter and without. Each adapter has zero weights on every module of PEFT's
"all-linear" (every one an adapter may target but the output head), at rank 16 or the engine's largest if lower
(the LoRA kernels are compiled for the engine's largest rank, whatever an adapter's); they are installed like any
other and taken out of their slots afterwards. What it cannot cover is still done at first use: the graphs of other
sets of targeted layers (a step's graph is keyed by the layers its installed adapters target together: adapters on
q and v only, or on the head too, capture their own), and Triton's specialisations on argument values a real step
may take first (an integer divisible by 16 or not).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from loraplex.lora.adapter import LoraAdapter, LoraConfig
from loraplex.lora.weights import LoraWeights
from loraplex.params import SamplingParams

WARM_UP_KEY = "\x00warm-up"  # no adapter id a user can name holds a NUL
WARM_UP_RANK = 16
SHORT_PROMPT, SHORT_NEW_TOKENS, LONG_NEW_TOKENS = 4, 3, 2


@dataclass(frozen=True)
class WarmUpReport:
    requests: int
    graphs_captured: int
    seconds: float


def warm_up(engine, decode_sizes: Sequence[int] | None = None) -> WarmUpReport:
    """Run the warm-up requests on `engine` (idle: no request in it); the engine is left as it was found, its
    KV blocks free and no adapter in a slot, with its graphs captured and its kernels compiled. `decode_sizes`:
    the batch sizes to decode at (default: the graphs' sizes; without graphs, one row)."""
    assert not engine.has_unfinished, "warm-up runs before the first request"
    started = time.perf_counter()
    graphs = engine.runner.decode_graphs
    captured_before = graphs.num_captured if graphs is not None else 0
    adapter = _zero_adapter(engine)
    second = _zero_adapter(engine, WARM_UP_KEY + "-2") if engine.lora.num_slots >= 2 else None
    tokens = _ordinary_tokens(engine)
    rng = random.Random(0)
    count = 0

    def run(lengths: list[int], new_tokens: int, adapters: list[LoraAdapter | None]) -> None:
        nonlocal count
        for length, used in zip(lengths, adapters):
            prompt = [rng.choice(tokens) for _ in range(length)]
            engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), adapter=used)
            count += 1
        while engine.has_unfinished:
            engine.step()

    long = _long_prompt_length(engine)
    if long > 0:
        run([long, long], LONG_NEW_TOKENS, [adapter, second])
    if decode_sizes is None:
        decode_sizes = graphs.sizes if graphs is not None else (1,)
    for rows in decode_sizes:
        for used in ([adapter, None] if adapter is not None else [None]):
            run([SHORT_PROMPT] * rows, SHORT_NEW_TOKENS, [used] * rows)
    for used in (adapter, second):
        if used is not None:
            engine.evict_adapter(used.key)
    captured = (graphs.num_captured if graphs is not None else 0) - captured_before
    return WarmUpReport(count, captured, time.perf_counter() - started)


def _zero_adapter(engine, key: str = WARM_UP_KEY) -> LoraAdapter | None:
    """Zero weights on every module PEFT's `target_modules="all-linear"` takes: all but the output head. A decode
    graph is captured per set of targeted layers, so this is the set whose graphs the warm-up leaves ready. None
    when the engine has no adapter slot or the model no such module."""
    rank = min(WARM_UP_RANK, engine.config.max_lora_rank)
    modules = {name: LoraWeights(torch.zeros(rank, n_in), torch.zeros(n_out, rank), 1.0)
               for name, (n_in, n_out) in engine.lora.base_shapes.items() if engine.lora.layers[name].row_kind != "logits"}
    if not engine.lora.num_slots or not modules:
        return None
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=tuple(sorted(modules)))
    return LoraAdapter(key, modules, config).packed()


def _ordinary_tokens(engine) -> list[int]:
    """Token ids that are not special (no image placeholder, no start or end of sequence)."""
    c = engine.model_config
    special = {c.bos_token_id, *c.eos_token_ids, engine.inputs.image_token_id}
    return [t for t in range(min(c.vocab_size, 1000)) if t not in special]


def _long_prompt_length(engine) -> int:
    """Two prompts of this length overflow one step's prompt budget, and fit the cache and the length limits."""
    c = engine.config
    budget = engine.scheduler.config.max_batch_prefill_tokens
    return max(0, min(c.max_input_length, engine.max_total_tokens - LONG_NEW_TOKENS, budget * 3 // 4,
                      engine.kv_capacity_tokens // 2 - 2 * engine.scheduler.config.block_size))

