"""Structured output's cost: the same requests unconstrained and constrained, in one run:
`python -m benchmarks.structured_output`.

Three settings on the embedded SmolLM2-135M-Instruct, `--requests` chat requests submitted at once, greedy:

- unconstrained: the reference;
- permissive: a regex every text matches, so every step computes and applies every row's mask while the tokens
  stay (nearly) those of the reference: the grammar engine's whole per-step cost;
- json schema: a small object schema (the answers then differ from the reference: tokens/s is what compares).

Printed: output tokens/s per setting and its ratio to unconstrained, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from time import perf_counter

from benchmarks.progress import progress
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.loading import load_model
from loraplex.params import GrammarSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer"},
                   "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
    "required": ["city", "population", "landmarks"], "additionalProperties": False,
}
QUESTIONS = ["Describe Paris.", "Describe Tokyo.", "Describe Cairo.", "Describe Lima.", "Describe Oslo.",
             "Describe Delhi.", "Describe Rome.", "Describe Quito."]
SETTINGS = {
    "unconstrained": None,
    "permissive regex": GrammarSpec("regex", r"[\s\S]*"),
    "json schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
}


def run(loaded, prompts, params: SamplingParams) -> tuple[float, list[list[int]]]:
    engine = Engine(loaded, EngineConfig(device="cpu", max_batch_total_tokens=8192))
    if params.grammar is not None:
        engine.compile_grammar(params.grammar)  # as the server does, before the request is queued
    started = perf_counter()
    finals = engine.generate(prompts, params)
    return perf_counter() - started, [f.token_ids for f in finals]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    log = progress()
    log(f"structured output's cost on cpu: {len(SETTINGS)} settings x {args.repeats} runs of {args.requests} requests "
        f"x <= {args.new_tokens} tokens (a few minutes on 2 cores)")
    log("loading the embedded model")
    loaded = load_model(EngineConfig(device="cpu"))
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."}]),
                          add_special_tokens=False) for i in range(args.requests)]
    best: dict[str, tuple[float, list[list[int]]]] = {}
    log("warming up each setting (and compiling its grammar)")
    for name, spec in SETTINGS.items():  # warm-up (and the grammar compile) excluded
        run(loaded, prompts[:1], SamplingParams(max_new_tokens=4, grammar=spec))
    for repeat in range(args.repeats):
        for name, spec in SETTINGS.items():
            log(f"timing {name} (run {repeat + 1} of {args.repeats})")
            seconds, outputs = run(loaded, prompts, SamplingParams(max_new_tokens=args.new_tokens, grammar=spec))
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, outputs)
    base_seconds, base_outputs = best["unconstrained"]
    base_rate = sum(map(len, base_outputs)) / base_seconds
    load = os.getloadavg()
    print(f"structured output: {args.requests} requests, <= {args.new_tokens} new tokens, greedy, {loaded.model_id} on cpu, "
          f"best of {args.repeats}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| setting | output tokens | tok/s | vs unconstrained | outputs equal to unconstrained |")
    print("|---|---|---|---|---|")
    for name, (seconds, outputs) in best.items():
        rate = sum(map(len, outputs)) / seconds
        same = sum(a == b for a, b in zip(outputs, base_outputs))
        print(f"| {name} | {sum(map(len, outputs))} | {rate:.1f} | {rate / base_rate:.2f}x | {same}/{len(outputs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
