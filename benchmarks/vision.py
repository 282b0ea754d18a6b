"""The vision workload: an example VLM serving image and text-only requests mixed, against transformers'
batched `generate` on the same inputs, timed in one run.

    loraplex bench --workload vision [--vision-model llava|mllama] [--requests 16] [--new-tokens 16] [--repeats 1]

Models: `llava` is `loraplex/smollm2-shapes` (LLaVA-NeXT), `mllama` is `loraplex/smollm2-mllama-shapes`
(Llama 3.2 Vision style). `--requests N` image requests (one generated picture each) and N text-only
requests, interleaved, all submitted at once to loraplex. transformers runs the same prompts left-padded:
LLaVA-NeXT as one batch; Mllama as two (the image requests, then the text-only ones: in one batch
transformers would let the text-only rows attend to the other requests' images). Greedy, EOS ignored, the
same number of new tokens for every request. Reports output tokens/s of both, the ratio, the seconds
loraplex spent in the image encoder and, for Mllama, the memory one image's stored states take.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from time import perf_counter

import torch

from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.example_models.vision import QUESTIONS, make_shape_image, user_message
from loraplex.params import SamplingParams

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


def run_loraplex(engine, jobs: list[VisionJob], new_tokens: int) -> tuple[float, int, float, list]:
    """(seconds, output tokens, seconds in the image encoder, the image requests) for all jobs at once,
    processing included."""
    processor, params = engine.processor, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    counters = engine.runner.vision_counters
    vision_before = counters.encode_seconds
    started = perf_counter()
    token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    image_requests = []
    for job in jobs:
        if job.image is None:
            engine.add_request(processor.tokenizer(job.prompt, add_special_tokens=False)["input_ids"], params)
            continue
        out = processor(text=job.prompt, images=[job.image], return_tensors="pt", add_special_tokens=False)
        images = ImageInputs.from_processor(out, [(job.image.height, job.image.width)], token_id)
        image_requests.append(engine.add_request(out["input_ids"][0].tolist(), params, images=images))
    tokens = 0
    while engine.has_unfinished:
        tokens += sum(1 for o in engine.step() if o.token is not None)
    return perf_counter() - started, tokens, counters.encode_seconds - vision_before, image_requests


@torch.inference_mode()
def run_transformers(model, processor, jobs: list[VisionJob], new_tokens: int, split: bool) -> tuple[float, int]:
    """(seconds, output tokens); `split`: image requests and text-only ones as two batches."""
    batches = [[j for j in jobs if j.image is not None], [j for j in jobs if j.image is None]] if split else [jobs]
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    started, tokens = perf_counter(), 0
    try:
        for batch in (b for b in batches if b):
            images = [j.image for j in batch if j.image is not None]
            if split and images:
                images = [[image] for image in images]  # Mllama: a list of images per prompt
            inputs = processor(text=[j.prompt for j in batch], images=images or None, return_tensors="pt", padding=True,
                               add_special_tokens=False).to(model.device)
            out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or 0)
            tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)
    finally:
        tokenizer.padding_side = side
    return perf_counter() - started, tokens


def _example(family: str):
    """(model id, assembled directory, transformers class) of the example VLM of `family`."""
    import transformers

    if family == "mllama":
        from loraplex.example_models.mllama import EXAMPLE_MLLAMA_MODEL_ID, example_mllama_dir

        return EXAMPLE_MLLAMA_MODEL_ID, example_mllama_dir(), transformers.MllamaForConditionalGeneration
    from loraplex.example_models.vision import EXAMPLE_VISION_MODEL_ID, example_model_dir

    return EXAMPLE_VISION_MODEL_ID, example_model_dir(), transformers.LlavaNextForConditionalGeneration


def state_memory(engine, requests) -> dict:
    """Mllama: per image, its states and the bytes they take: what the cross layers' keys/values need, and
    what the state pool's blocks holding them reserve (whole blocks, in the cross layers' caches only)."""
    config = engine.model_config
    images = sum(r.images.num_images for r in requests)
    states = sum(r.num_states for r in requests) / images
    per_state = 2 * config.num_kv_heads * config.head_dim * len(config.mllama.cross_attention_layers)
    per_state *= torch.finfo(engine.dtype).bits // 8
    bs = engine.scheduler.config.block_size
    blocks = sum(-(-r.num_states // bs) for r in requests) / images
    return {
        "states_per_image": states,
        "state_bytes_per_image": states * per_state,
        "reserved_bytes_per_image": blocks * bs * per_state,
    }


def bench_vision(requests: int, new_tokens: int, repeats: int, seed: int = 0, family: str = "llava") -> dict:
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    model_id, directory, hf_class = _example(family)
    engine = Engine.from_config(EngineConfig(model_id=model_id))
    hf = hf_class.from_pretrained(directory, dtype=engine.dtype).to(engine.device).eval()
    split = family == "mllama"
    jobs = vision_jobs(engine.processor, requests, seed)
    run_loraplex(engine, jobs[:4], 2)  # warm-up (excluded)
    run_transformers(hf, engine.processor, jobs[:4], 2, split)
    best = {"loraplex": None, "transformers": None}
    for _ in range(repeats):
        ours = run_loraplex(engine, jobs, new_tokens)
        theirs = run_transformers(hf, engine.processor, jobs, new_tokens, split)
        if best["loraplex"] is None or ours[0] < best["loraplex"][0]:
            best["loraplex"] = ours
        if best["transformers"] is None or theirs[0] < best["transformers"][0]:
            best["transformers"] = theirs
    (ours_s, ours_tokens, vision_s, image_requests), (hf_s, hf_tokens) = best["loraplex"], best["transformers"]
    result = {
        "model": model_id, "requests": len(jobs), "image_requests": requests, "new_tokens": new_tokens,
        "loraplex_tokens_per_s": ours_tokens / ours_s, "transformers_tokens_per_s": hf_tokens / hf_s,
        "ratio": (ours_tokens / ours_s) / (hf_tokens / hf_s), "loraplex_seconds": ours_s,
        "vision_tower_seconds": vision_s, "transformers_seconds": hf_s, "load_average": os.getloadavg()[0],
    }
    if family == "mllama":
        result.update(state_memory(engine, image_requests))
    return result


def format_vision(result: dict) -> str:
    lines = [
        f"vision workload ({result['model']}): {result['image_requests']} image + "
        f"{result['requests'] - result['image_requests']} text-only requests, {result['new_tokens']} new tokens each "
        f"(load average {result['load_average']:.2f})",
        f"  loraplex      {result['loraplex_tokens_per_s']:8.1f} tok/s  ({result['loraplex_seconds']:.2f} s, of which "
        f"image encoder {result['vision_tower_seconds']:.2f} s)",
        f"  transformers  {result['transformers_tokens_per_s']:8.1f} tok/s  ({result['transformers_seconds']:.2f} s, batched generate)",
        f"  ratio         {result['ratio']:.2f}x",
    ]
    if "states_per_image" in result:
        lines.append(
            f"  image states  {result['states_per_image']:.0f} per image: {result['state_bytes_per_image'] / 2**10:.0f} KiB "
            f"of cross-layer keys/values, {result['reserved_bytes_per_image'] / 2**10:.0f} KiB of state blocks reserved"
        )
    return "\n".join(lines)
