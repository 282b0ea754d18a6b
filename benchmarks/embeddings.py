"""Embeddings throughput: loraplex's engine against transformers on the same inputs, in one run.

    loraplex bench --workload embeddings [--requests 256] [--adapters 4] [--seed 0] [--repeats 1]

`--requests` inputs of 64 to 256 tokens (seeded), each pooled to one vector: loraplex's engine (prefill-only requests,
last-token pooling, L2-normalised, as /v1/embeddings does) on the base model and spread over `--adapters` random
adapters (rank 16 on every projection), against transformers running the base model over the same inputs in padded
batches of 32 (right-padded, attention-masked, each row's last real token pooled). Printed: inputs/s and the ratios,
and the largest distance between the base vectors of loraplex and transformers (a sanity check).
"""

from __future__ import annotations

import random
from time import perf_counter

import torch

from benchmarks.adapters import AdapterSpec, random_adapter
from loraplex.params import Pooling, SamplingParams

HF_BATCH = 32


def inputs_of(count: int, vocab: int, special: set[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ordinary = [t for t in range(3, vocab) if t not in special]
    return [[rng.choice(ordinary) for _ in range(rng.randint(64, 256))] for _ in range(count)]


def loraplex_vectors(engine, inputs: list[list[int]], adapters: list | None) -> list[list[float]]:
    params = SamplingParams(max_new_tokens=1, pooling=Pooling("last", True))
    outs = engine.generate(inputs, params, adapters=adapters)
    return [o.embedding for o in outs]


@torch.inference_mode()
def transformers_vectors(model, inputs: list[list[int]], pad: int) -> list[torch.Tensor]:
    vectors = []
    for start in range(0, len(inputs), HF_BATCH):
        batch = inputs[start : start + HF_BATCH]
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(batch):
            ids[row, : len(item)] = torch.tensor(item)
            mask[row, : len(item)] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
        vectors += list(torch.nn.functional.normalize(last, dim=1))
    return vectors


def timed(run, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        started = perf_counter()
        out = run()
        best = min(best, perf_counter() - started)
    return best, out


def bench_embeddings(engine, hf_model, pad: int, args, log=print) -> dict:
    vocab = engine.model_config.vocab_size
    special = set(engine.tokenizer.hf.all_special_ids)
    inputs = inputs_of(args.requests, vocab, special, args.seed)
    spec = AdapterSpec(rank=16, alpha=32.0)
    adapters = [random_adapter(f"embed-{i}", engine.lora.base_shapes, spec, engine.config.max_lora_rank, seed=i)
                for i in range(args.adapters)]
    per_input = [adapters[i % len(adapters)] for i in range(len(inputs))] if adapters else None
    loraplex_vectors(engine, inputs[:4], None)  # warm-up
    log(f"embeddings: timing loraplex on {len(inputs)} inputs (base)")
    base_s, ours = timed(lambda: loraplex_vectors(engine, inputs, None), args.repeats)
    adapters_s = None
    if per_input:
        log(f"embeddings: timing loraplex on {len(inputs)} inputs over {len(adapters)} adapters")
        adapters_s, _ = timed(lambda: loraplex_vectors(engine, inputs, per_input), args.repeats)
    log(f"embeddings: timing transformers on {len(inputs)} inputs (batches of {HF_BATCH})")
    hf_s, theirs = timed(lambda: transformers_vectors(hf_model, inputs, pad), args.repeats)
    gap = max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(ours, theirs))
    return {"inputs": len(inputs), "tokens": sum(len(i) for i in inputs), "loraplex_s": base_s,
            "loraplex_adapters_s": adapters_s, "adapters": len(adapters), "transformers_s": hf_s, "max_abs_diff": gap}


def format_embeddings(result: dict, setting: str) -> str:
    n = result["inputs"]
    rate = lambda s: n / s  # noqa: E731
    lines = [f"workload embeddings: {n} inputs of 64..256 tokens ({result['tokens']} tokens), last-token pooling, "
             f"{setting}",
             f"  loraplex                         {rate(result['loraplex_s']):>8.1f} inputs/s",
             f"  transformers batched ({HF_BATCH})        {rate(result['transformers_s']):>8.1f} inputs/s   "
             f"loraplex = {result['transformers_s'] / result['loraplex_s']:.2f}x"]
    if result["loraplex_adapters_s"] is not None:
        lines.append(f"  loraplex, {result['adapters']} adapters             {rate(result['loraplex_adapters_s']):>8.1f} "
                     f"inputs/s   = {result['loraplex_s'] / result['loraplex_adapters_s']:.2f}x of loraplex base")
    lines.append(f"  sanity: largest |difference| between loraplex's and transformers' base vectors "
                 f"{result['max_abs_diff']:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.embeddings --model 8b`: loraplex alone (no transformers peer holds the random weights) on
    a random model of Llama-3.1-8B's shape on the GPU, base against 4 adapters: inputs/s. `loraplex bench --workload
    embeddings` is the CPU run against transformers."""
    import argparse

    from benchmarks.progress import needs_cuda, progress
    from benchmarks.random_models import llama_8b
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("--model", choices=["8b"], default="8b")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.embeddings --model 8b")) is not None:
        return code
    log(f"building a random {args.layers}-layer model of Llama-3.1-8B's shape on the GPU")
    engine = Engine(llama_8b(torch.device("cuda"), args.layers), EngineConfig(max_active_adapters=max(8, args.adapters)))
    inputs = inputs_of(args.requests, engine.model_config.vocab_size, {0, 1, 2}, args.seed)
    spec = AdapterSpec(rank=16, alpha=32.0)
    adapters = [random_adapter(f"embed-{i}", engine.lora.base_shapes, spec, engine.config.max_lora_rank, seed=i)
                for i in range(args.adapters)]
    loraplex_vectors(engine, inputs[:8], adapters[:1] * 8)  # warm-up (kernels, first installs)
    log(f"timing {len(inputs)} inputs, base")
    base_s, _ = timed(lambda: loraplex_vectors(engine, inputs, None), args.repeats)
    log(f"timing {len(inputs)} inputs over {len(adapters)} adapters")
    tuned_s, _ = timed(lambda: loraplex_vectors(engine, inputs, [adapters[i % len(adapters)] for i in range(len(inputs))]),
                       args.repeats)
    tokens = sum(len(i) for i in inputs)
    print(f"embeddings, {args.layers}-layer Llama-3.1-8B shape, bf16, {torch.cuda.get_device_name()}: {len(inputs)} "
          f"inputs ({tokens} tokens): base {len(inputs) / base_s:.1f} inputs/s ({tokens / base_s:,.0f} tok/s), "
          f"{len(adapters)} adapters {len(inputs) / tuned_s:.1f} inputs/s ({base_s / tuned_s:.2f}x of base)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
