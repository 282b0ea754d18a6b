"""Speculative decoding (n-gram prompt lookup, `--speculative-tokens N`) on a copy-heavy workload, speculation off
against N drafts in one run: `python -m benchmarks.speculative`.

    python -m benchmarks.speculative [--speculative-tokens 0,3,5] [--requests 4] [--new-tokens 128] [--repeats 1]
                                     [--threads N] [--model-id ID] [--json PATH]

The workload: `--requests` chat requests on the embedded SmolLM2-135M-Instruct (or `--model-id`), each asking to
repeat, copy or quote one of a few paragraphs (~100 tokens each), greedy, at most `--new-tokens` new tokens
(EOS ends a request: outputs are identical in every setting, so each setting generates the same tokens). All
requests are submitted at once to a fresh engine per setting; each setting is warmed up once (excluded) and
the settings take turns `--repeats` times, each keeping its best time.

Printed per setting: output tokens/s and its ratio to speculation off (the figure that matters on a shared
machine: rates measured in one run compare), engine steps, tokens kept per decoding request per step (1.0
without speculation), drafts verified and accepted (the engine's counters) and their ratio, and whether every
output equals the one without speculation. The load average is printed with the figures: on a busy machine
the ratios, not the rates, are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import asdict, dataclass
from time import perf_counter

import torch

from benchmarks.progress import progress
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import load_model
from loraplex.params import SamplingParams

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every evening the keeper "
    "climbed the narrow spiral stairs, trimmed the wick, polished the great lens and lit the lamp, so that the "
    "fishing boats coming home through the fog could find the harbour. When the storms came in winter, he stayed "
    "awake all night, listening to the waves breaking on the rocks below.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into sugar "
    "and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts, which contain "
    "the green pigment chlorophyll. The sugar feeds the plant and helps it grow, while the oxygen is released into "
    "the air, where animals and people breathe it.",
    "To make pancakes, mix two cups of flour, two eggs, a spoon of sugar, a pinch of salt and two cups of milk in a "
    "large bowl until the batter is smooth. Heat a little butter in a pan over a medium flame, pour in a ladle of "
    "batter and cook it until bubbles appear on the surface. Turn the pancake over, cook the other side for a "
    "minute and serve it warm with fruit or honey.",
    "The city council met on Tuesday evening to discuss the new bicycle lanes on the main street. Several shop "
    "owners worried that the lanes would remove parking spaces and keep customers away, while parents said that "
    "their children would finally be able to ride to school safely. After a long debate, the council agreed to "
    "test the lanes for six months and to count the cyclists and the shoppers every week.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:",
    "Copy this paragraph without changing anything:",
    "Quote this paragraph in full, then stop:",
]


@dataclass
class Result:
    setting: int  # speculative tokens (0: off)
    seconds: float
    tokens: int
    steps: int
    decode_request_steps: int  # (request, step) pairs in which a request decoded (verified drafts or not)
    decode_tokens: int  # tokens kept in those steps (each request's first token comes from its prefill)
    drafted: int
    accepted: int
    identical: bool = True  # every output equals the one without speculation

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_decode_step(self) -> float:
        """Tokens a decoding request kept per step."""
        return self.decode_tokens / max(1, self.decode_request_steps)


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
        out.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                    add_special_tokens=False))
    return out


def run(loaded, setting: int, workload: list[list[int]], params: SamplingParams) -> tuple[Result, list[list[int]]]:
    """One timed run on a fresh engine (its KV cache and counters new; the model shared)."""
    engine = Engine(loaded, EngineConfig(device=str(loaded.device), max_batch_total_tokens=8192,
                                         speculative_tokens=setting))
    requests = [engine.add_request(p, params) for p in workload]
    steps = decode_request_steps = 0
    start = perf_counter()
    while engine.has_unfinished:
        decode_request_steps += sum(1 for r in engine.scheduler.running if r.output_ids)
        engine.step()
        steps += 1
    seconds = perf_counter() - start
    outputs = [r.output_ids for r in requests]
    tokens = sum(len(o) for o in outputs)
    spec = engine.spec_decode
    result = Result(setting, seconds, tokens, steps, decode_request_steps, tokens - len(outputs), spec.draft_tokens,
                    spec.accepted_tokens)
    return result, outputs


def format_table(results: list[Result], args: argparse.Namespace, device: str) -> str:
    off = next(r for r in results if r.setting == 0)
    lines = [
        f"speculative decoding (n-gram prompt lookup), {args.requests} copy-heavy requests, greedy, "
        f"<= {args.new_tokens} new tokens, {device}, {torch.get_num_threads()} thread(s)"
        f"{f', best of {args.repeats}' if args.repeats > 1 else ''}; load average {os.getloadavg()[0]:.2f}",
        "",
        "| speculative tokens | tok/s | vs off | steps | tokens / decoding request / step | drafted | accepted "
        "| accepted / drafted | outputs identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ratio = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
        lines.append(
            f"| {r.setting or 'off'} | {r.tokens_per_s:.1f} | {r.tokens_per_s / off.tokens_per_s:.2f}x | {r.steps} | "
            f"{r.tokens_per_decode_step:.2f} | {r.drafted} | {r.accepted} | {ratio} | {'yes' if r.identical else 'NO'} |"
        )
    lines.append(f"\n{off.tokens} output tokens per run")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--speculative-tokens", default="0,3,5", help="comma-separated settings; 0 (off) is always run")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting, taking turns; the best is kept")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--model-id", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--random-shape", choices=["135m", "8b"], default=None,
                   help="a random-weight model of SmolLM2-135M's or Llama-3.1-8B's shape instead (GPU); prompts are a "
                        "random 32-token segment said four times; EOS ignored. Only the 135M shape carries such a "
                        "loop on: the 8B shape gives no drafts, only their cost")
    p.add_argument("--layers", type=int, default=32, help="--random-shape 8b: layers")
    p.add_argument("--device", default=None)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = sorted({0, *(int(s) for s in args.speculative_tokens.split(",") if s.strip())})
    device_name = args.device or ("cuda" if args.random_shape or torch.cuda.is_available() else "cpu")
    log(f"speculative decoding, settings {','.join(map(str, settings))} x {args.repeats} run(s) of {args.requests} "
        f"requests x <= {args.new_tokens} tokens, {args.random_shape or args.model_id or 'embedded SmolLM2-135M'} on "
        f"{device_name}, {torch.get_num_threads()} thread(s)"
        + (" (on a CPU: minutes a setting)" if device_name == "cpu" else " (a minute or two)"))
    if args.random_shape:
        from benchmarks.random_models import LLAMA_8B_VOCAB, llama_8b, smollm2_135m

        device = torch.device(args.device or "cuda")
        log(f"building the random {args.random_shape}-shaped model")
        loaded = llama_8b(device, args.layers) if args.random_shape == "8b" else smollm2_135m(device)
        rng = random.Random(0)
        # A random segment said four times: drafts can only come from such repetition in a random model.
        workload = [[rng.randrange(3, LLAMA_8B_VOCAB) for _ in range(32)] * 4 for _ in range(args.requests)]
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    else:
        log(f"loading {args.model_id or 'the embedded model'}")
        loaded = load_model(EngineConfig(model_id=args.model_id, device=args.device))
        workload = prompts(loaded.tokenizer, args.requests)
        params = SamplingParams(max_new_tokens=args.new_tokens)
    for setting in settings:  # warm-up, excluded
        log(f"warm-up, speculative tokens {setting or 'off'}")
        run(loaded, setting, workload[:1], SamplingParams(max_new_tokens=8))
    best: dict[int, tuple[Result, list[list[int]]]] = {}
    for repeat in range(args.repeats):
        for setting in settings:
            log(f"timing speculative tokens {setting or 'off'} (run {repeat + 1} of {args.repeats})")
            result, outputs = run(loaded, setting, workload, params)
            if setting not in best or result.seconds < best[setting][0].seconds:
                best[setting] = (result, outputs)
    reference = best[0][1]
    results = []
    for setting in settings:
        result, outputs = best[setting]
        result.identical = outputs == reference
        results.append(result)
    print(format_table(results, args, str(loaded.device)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_average": os.getloadavg()[0], "threads": torch.get_num_threads(),
                       "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]}, f, indent=2)
    return 0 if all(r.identical for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
