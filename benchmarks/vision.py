"""The vision workload: the example VLM (`loraplex/smollm2-shapes`) serving image and text-only requests
mixed, against transformers' batched `generate` on the same inputs, timed in one run.

    loraplex bench --workload vision [--requests 16] [--new-tokens 16] [--repeats 1]

`--requests N` image requests (one generated picture each, any-resolution sizes) and N text-only requests,
interleaved, all submitted at once to loraplex; transformers runs the same prompts as one left-padded batch
(images in order). Greedy, EOS ignored, the same number of new tokens for every request. Reports output
tokens/s of both, the ratio, and the seconds loraplex spent in the vision tower and projector.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from time import perf_counter

import torch

from loraplex.engine.images import ImageInputs
from loraplex.params import SamplingParams
from loraplex.vision_example import QUESTIONS, make_shape_image, user_message

TEXT_QUESTIONS = ("What is the capital of France?", "Name three colours.", "What is two plus two?", "Say hello.")


@dataclass
class VisionJob:
    prompt: str  # after the chat template, with the processor's <image> placeholder where an image goes
    image: object | None  # a PIL image or None


def vision_jobs(processor, n: int, seed: int) -> list[VisionJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        picture = make_shape_image(rng).image
        question = QUESTIONS[i % len(QUESTIONS)]
        jobs.append(VisionJob(processor.apply_chat_template(user_message(question), add_generation_prompt=True), picture))
        text = [{"role": "user", "content": [{"type": "text", "text": TEXT_QUESTIONS[i % len(TEXT_QUESTIONS)]}]}]
        jobs.append(VisionJob(processor.apply_chat_template(text, add_generation_prompt=True), None))
    return jobs


def run_loraplex(engine, jobs: list[VisionJob], new_tokens: int) -> tuple[float, int, float]:
    """(seconds, output tokens, seconds in the vision tower) for all jobs at once, processing included."""
    processor, params = engine.processor, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    features = engine.runner.image_features
    vision_before = features.encode_seconds
    started = perf_counter()
    token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    for job in jobs:
        if job.image is None:
            ids, images = processor.tokenizer(job.prompt, add_special_tokens=False)["input_ids"], None
        else:
            out = processor(text=job.prompt, images=[job.image], return_tensors="pt", add_special_tokens=False)
            ids = out["input_ids"][0].tolist()
            images = ImageInputs.for_prompt(ids, out["pixel_values"], out["image_sizes"].tolist(), token_id)
        engine.add_request(ids, params, images=images)
    tokens = 0
    while engine.has_unfinished:
        tokens += sum(1 for o in engine.step() if o.token is not None)
    return perf_counter() - started, tokens, features.encode_seconds - vision_before


@torch.inference_mode()
def run_transformers(model, processor, jobs: list[VisionJob], new_tokens: int) -> tuple[float, int]:
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    started = perf_counter()
    try:
        images = [j.image for j in jobs if j.image is not None]
        inputs = processor(text=[j.prompt for j in jobs], images=images or None, return_tensors="pt", padding=True,
                           add_special_tokens=False).to(model.device)
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or 0)
    finally:
        tokenizer.padding_side = side
    return perf_counter() - started, (out.shape[1] - inputs["input_ids"].shape[1]) * len(jobs)


def bench_vision(requests: int, new_tokens: int, repeats: int, seed: int = 0) -> dict:
    from transformers import LlavaNextForConditionalGeneration

    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine
    from loraplex.vision_example import EXAMPLE_VISION_MODEL_ID, example_model_dir

    engine = Engine.from_config(EngineConfig(model_id=EXAMPLE_VISION_MODEL_ID))
    hf = LlavaNextForConditionalGeneration.from_pretrained(example_model_dir(), dtype=engine.dtype).to(engine.device).eval()
    jobs = vision_jobs(engine.processor, requests, seed)
    run_loraplex(engine, jobs[:4], 2)  # warm-up (excluded)
    run_transformers(hf, engine.processor, jobs[:4], 2)
    best = {"loraplex": None, "transformers": None}
    for _ in range(repeats):
        ours = run_loraplex(engine, jobs, new_tokens)
        theirs = run_transformers(hf, engine.processor, jobs, new_tokens)
        if best["loraplex"] is None or ours[0] < best["loraplex"][0]:
            best["loraplex"] = ours
        if best["transformers"] is None or theirs[0] < best["transformers"][0]:
            best["transformers"] = theirs
    (ours_s, ours_tokens, vision_s), (hf_s, hf_tokens) = best["loraplex"], best["transformers"]
    return {
        "requests": len(jobs), "image_requests": requests, "new_tokens": new_tokens,
        "loraplex_tokens_per_s": ours_tokens / ours_s, "transformers_tokens_per_s": hf_tokens / hf_s,
        "ratio": (ours_tokens / ours_s) / (hf_tokens / hf_s), "loraplex_seconds": ours_s,
        "vision_tower_seconds": vision_s, "transformers_seconds": hf_s, "load_average": os.getloadavg()[0],
    }


def format_vision(result: dict) -> str:
    return (
        f"vision workload: {result['image_requests']} image + {result['requests'] - result['image_requests']} text-only "
        f"requests, {result['new_tokens']} new tokens each (load average {result['load_average']:.2f})\n"
        f"  loraplex      {result['loraplex_tokens_per_s']:8.1f} tok/s  ({result['loraplex_seconds']:.2f} s, of which "
        f"vision tower {result['vision_tower_seconds']:.2f} s)\n"
        f"  transformers  {result['transformers_tokens_per_s']:8.1f} tok/s  ({result['transformers_seconds']:.2f} s, batched generate)\n"
        f"  ratio         {result['ratio']:.2f}x"
    )
