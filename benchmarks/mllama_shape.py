"""Mllama at Llama-3.2-11B-Vision's shape on a GPU: random bfloat16 weights, loraplex against transformers'
batched `generate` on the same requests, in one process.

    python -m benchmarks.mllama_shape [--image-requests 16] [--text-requests 16] [--prompt 128] [--new 64]

Each image request has one 4-tile picture (aspect ratio 2x2: 4 x 1025 image states) and its `<|image|>` token
first; text-only requests have none. transformers runs the image requests as one batch and the text-only
ones as another (in one batch it would let text-only rows attend to other requests' images). Greedy, EOS
ignored. Random weights leave the cross-attention gates at 0: the cross layers still compute in both systems,
they only add nothing. Reports tokens/s, the image encoder's share, and the memory one image's states take.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.progress import needs_cuda, progress

TEXT = dict(  # Llama-3.2-11B-Vision's text model
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
    num_key_value_heads=8, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38], rope_theta=500000.0,
)
ASPECT_RATIO_2X2 = 6  # 1 + index of [2, 2] in the default supported_aspect_ratios


def build(device: str):
    import transformers

    from loraplex.models.registry import config_from_hf
    from loraplex.engine.loading import build_model

    config = transformers.MllamaConfig(text_config=TEXT, vision_config={}, image_token_index=TEXT["vocab_size"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = transformers.MllamaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    ours_config = config_from_hf(config.to_dict())
    return hf, build_model(ours_config, dict(hf.state_dict())), ours_config


def requests(args, tiles: int, size: int):
    g = torch.Generator().manual_seed(1)
    image_token = TEXT["vocab_size"]
    jobs = []
    for i in range(args.image_requests + args.text_requests):
        ids = torch.randint(0, image_token, (args.prompt,), generator=g).tolist()
        pixels = None
        if i < args.image_requests:
            ids[0] = image_token
            pixels = torch.randn(1, tiles, 3, size, size, generator=g)
        jobs.append((ids, pixels))
    return jobs


def run_ours(engine, jobs, new: int) -> tuple[float, int, list]:
    from loraplex.multimodal.image_inputs import ImageInputs
    from loraplex.params import SamplingParams

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    started, tokens, image_requests = time.perf_counter(), 0, []
    for ids, pixels in jobs:
        images = None
        if pixels is not None:
            tiles = pixels.shape[1]
            images = ImageInputs.for_prompt(
                ids, pixels, [(896, 896)], TEXT["vocab_size"], aspect_ratio_ids=torch.tensor([ASPECT_RATIO_2X2]),
                aspect_ratio_mask=torch.ones(1, tiles, dtype=torch.long),
            )
        request = engine.add_request(ids, params, images=images)
        if images is not None:
            image_requests.append(request)
    while engine.has_unfinished:
        tokens += sum(1 for o in engine.step() if o.token is not None)
    torch.cuda.synchronize()
    return time.perf_counter() - started, tokens, image_requests


@torch.inference_mode()
def run_transformers(hf, jobs, new: int) -> tuple[float, int]:
    started, tokens = time.perf_counter(), 0
    for batch in ([j for j in jobs if j[1] is not None], [j for j in jobs if j[1] is None]):
        if not batch:
            continue
        ids = torch.tensor([j[0] for j in batch], device=hf.device)
        kwargs = {}
        if batch[0][1] is not None:
            tiles = batch[0][1].shape[1]
            kwargs = dict(
                pixel_values=torch.stack([j[1] for j in batch]).to(hf.device, torch.bfloat16),
                aspect_ratio_ids=torch.full((len(batch), 1), ASPECT_RATIO_2X2, device=hf.device),
                aspect_ratio_mask=torch.ones(len(batch), 1, tiles, dtype=torch.long, device=hf.device),
                cross_attention_mask=torch.ones(len(batch), ids.shape[1], 1, tiles, dtype=torch.long, device=hf.device),
            )
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
        tokens += (out.shape[1] - ids.shape[1]) * len(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - started, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-requests", type=int, default=16)
    p.add_argument("--text-requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=131072, help="token slots (and as many image-state slots)")
    args = p.parse_args(argv)
    log = progress()
    if (code := needs_cuda("benchmarks.mllama_shape")) is not None:
        return code
    log(f"Mllama 11B shape, loraplex against transformers, on {torch.cuda.get_device_name()}: "
        f"{args.image_requests} image + {args.text_requests} text requests (a few minutes)")

    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine
    from loraplex.engine.loading import LoadedModel

    log("building the random Mllama 11B-shaped model and its transformers twin")
    hf, ours, config = build("cuda")
    vision = config.mllama.vision
    loaded = LoadedModel(ours, config, None, torch.device("cuda"), torch.bfloat16, "mllama-11b-shape")
    engine = Engine(loaded, EngineConfig(max_batch_total_tokens=args.kv_tokens, max_batch_prefill_tokens=16384))
    jobs = requests(args, vision.max_num_tiles, vision.image_size)
    log("warming up both")
    run_ours(engine, jobs[:2], 2)  # warm-up
    run_transformers(hf, jobs[:1] + jobs[-1:], 2)
    counters = engine.runner.vision_counters
    before = counters.encode_seconds
    log("timing loraplex")
    ours_s, ours_tokens, image_requests = run_ours(engine, jobs, args.new)
    log("timing transformers' batched generate")
    hf_s, hf_tokens = run_transformers(hf, jobs, args.new)
    per_state = 2 * config.num_kv_heads * config.head_dim * len(config.mllama.cross_attention_layers) * 2
    states = image_requests[0].num_states
    print(f"Mllama 11B shape, bf16, {args.image_requests} image (4 tiles) + {args.text_requests} text-only requests, "
          f"{args.prompt} prompt / {args.new} new tokens")
    print(f"  loraplex      {ours_tokens / ours_s:8.1f} tok/s ({ours_s:.2f} s; image encoder host time "
          f"{counters.encode_seconds - before:.2f} s)")
    print(f"  transformers  {hf_tokens / hf_s:8.1f} tok/s ({hf_s:.2f} s, batched generate)")
    print(f"  ratio         {(ours_tokens / ours_s) / (hf_tokens / hf_s):.2f}x")
    print(f"  image states  {states} per image: {states * per_state / 2**20:.1f} MiB of cross-layer keys/values")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
