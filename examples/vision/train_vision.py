"""Train the example vision-language model `loraplex/smollm2-shapes` on CPU, reproducibly.

    .venv/bin/python examples/vision/train_vision.py                       # the shipped run (15-20 min, 2 cores)
    .venv/bin/python examples/vision/train_vision.py --out /tmp/shapes --stage1-steps 50 --stage2-steps 10 --eval-images 32

What it makes: a `transformers.LlavaNextForConditionalGeneration` whose language model is the embedded
SmolLM2-135M-Instruct (``loraplex.checkpoints.sources.resolve_model(None)``; frozen, unchanged) and whose vision side
is new: a 4-layer CLIP vision tower (hidden 128, 64x64 tiles of 16x16 patches), the 2-layer projector
into SmolLM2's 576-wide embeddings and `image_newline`. The tokenizer gets one new special token,
`<image>` (id 49152; its embedding row, never seen by the model since image features replace it, is
the mean of the other rows). Any-resolution tiling (LLaVA-NeXT) over the grids 64x64, 64x128, 128x64
and 128x128: 26 to 88 image tokens per picture (57 on average).

Data: synthetic pictures from `loraplex.example_models.vision.make_shape_image` (one shape, one of 8 named
colours, on a plain, gradient or two-tone background of other colours; 40-224 pixels a side, aspect
ratios up to 1:3), generated on the fly from a seeded `random.Random`.

Training, two stages (only the vision tower, projector and image_newline change; SmolLM2 is frozen):

1. The vision tower alone, with a throw-away probe (attention pooling + linear heads) that names the
   shape's colour and the shape: cheap (no language model), so the tower learns to find the shape and
   read its colour in a couple of minutes.
2. Tower, projector and image_newline through the frozen language model: chat-formatted questions
   ("What colour is the shape?" and 6 paraphrases; the picture before the question, now and then after
   it) with the answer "The shape is <colour>." + <|im_end|>; the loss is taken on the answer tokens only.

At the end the parts are written (float16) to --out, the full checkpoint is assembled from them exactly
as `loraplex.example_models.vision.example_model_dir` does (in a temp dir), loaded back with
`LlavaNextForConditionalGeneration.from_pretrained` + `AutoProcessor.from_pretrained`, and evaluated with
greedy `generate` on --eval-images held-back pictures (another seed): the accuracy is the share of
answers that name the right colour (and no other). The script writes a README.md with the numbers next
to the parts, and exits 1 if the accuracy is under --min-accuracy.

Determinism: fixed seeds, data from seeded generators in a fixed order, `torch.set_num_threads` (2 by
default), `torch.use_deterministic_algorithms(True)`; the same versions of torch and transformers on
the same kind of CPU with the same thread count give the same parts (another thread count changes the
float rounding, and the parts come out slightly different).

Time: on an idle 2-core machine a stage-1 step takes about 0.3 s and a stage-2 step about 3 s (the
frozen 135M language model, forward and backward, over 8 sequences of ~100 tokens), so the default run
is about 5 + 10 minutes of training plus a minute of evaluation. On a machine shared with other jobs
it is slower (the shipped run's numbers are in the README next to the parts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import shutil
import sys
import tempfile
import time

# Threads that wait for work sleep instead of spinning: on a machine shared with other jobs, spinning
# OpenMP threads that get preempted made each step 3-4 times slower. Set before torch starts its pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from loraplex.example_models.vision import (  # noqa: E402
    ADDED_EMBEDDINGS,
    ANSWER,
    COLOURS,
    EXAMPLE_VISION_MODEL_ID,
    PARTS_DIR,
    PARTS_FILE,
    QUESTIONS,
    SHAPES,
    TOKENIZER_ADDITIONS,
    assemble_example_model,
    colour_in_answer,
    generate_answers,
    make_shape_image,
    user_message,
)

SEED = 20251201  # model init, training data
EVAL_SEED = 4242  # held-back pictures for the final evaluation
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 64
PATCH_SIZE = 16
GRID_PINPOINTS = [[64, 64], [64, 128], [128, 64], [128, 128]]  # (height, width)
VISION_FEATURE_LAYERS = [-3, -1]  # hidden states after the 2nd and 4th CLIP layer, concatenated
VISION = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_act="quick_gelu",
)
IMAGE_AFTER_TEXT = 0.15  # share of training prompts with the picture after the question

# SmolLM2's ChatML template (same default system prompt), with content given either as a string or as a
# list of parts: {"type": "image"} becomes "<image>\n" where it stands, {"type": "text"} its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_STARTED = time.perf_counter()


def log(msg: str) -> None:
    elapsed = time.perf_counter() - _STARTED
    print(f"[{elapsed:7.1f}s wall, {time.process_time():7.1f}s cpu] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------
# Model, tokenizer, processor


def build_processor(base_dir: pathlib.Path):
    from transformers import AutoTokenizer, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(base_dir, extra_special_tokens={"image_token": IMAGE_TOKEN})
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=GRID_PINPOINTS,
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, dropped by the "default" strategy
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def build_model(base_dir: pathlib.Path, tokenizer):
    from transformers import AutoConfig, CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    from loraplex.checkpoints.weights import load_state_dict

    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = AutoConfig.from_pretrained(base_dir)
    if image_token_id != text_config.vocab_size:
        raise SystemExit(f"{IMAGE_TOKEN} got id {image_token_id}, expected the first free id {text_config.vocab_size}")
    text_config.vocab_size = len(tokenizer)
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text_config,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=VISION_FEATURE_LAYERS,
        image_grid_pinpoints=GRID_PINPOINTS,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        tie_word_embeddings=True,
    )
    config.architectures = ["LlavaNextForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = LlavaNextForConditionalGeneration(config)

    state = load_state_dict(base_dir, dtype=torch.float32)
    embed = state["model.embed_tokens.weight"]
    new_rows = embed.mean(dim=0, keepdim=True).expand(len(tokenizer) - embed.shape[0], -1)
    state["model.embed_tokens.weight"] = torch.cat([embed, new_rows], dim=0)
    lm_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    missing, unexpected = model.model.language_model.load_state_dict(lm_state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"loading SmolLM2 into the language model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    for p in model.model.language_model.parameters():
        p.requires_grad_(False)
    return model


def trained_parameters(model) -> dict[str, nn.Parameter]:
    """The parameters training changes, by their names in the saved checkpoint."""
    m = model.model
    named = {"image_newline": m.image_newline}
    named.update({f"vision_tower.{k}": p for k, p in m.vision_tower.named_parameters()})
    named.update({f"multi_modal_projector.{k}": p for k, p in m.multi_modal_projector.named_parameters()})
    return named


# --------------------------------------------------------------------------------------------------
# Data


def process_one(processor, image, text: str) -> dict:
    enc = processor(images=[image], text=[text], return_tensors="pt")
    return {k: enc[k][0] for k in ("input_ids", "pixel_values", "image_sizes")}


def collate(items: list[dict], pad_id: int) -> dict:
    """Left-pad input ids (so every row ends with its answer) and zero-pad the tiles."""
    length = max(len(it["input_ids"]) for it in items)
    tiles = max(it["pixel_values"].shape[0] for it in items)
    ids = torch.full((len(items), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), length), dtype=torch.long)
    pixels = torch.zeros((len(items), tiles, *items[0]["pixel_values"].shape[1:]))
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        ids[i, length - n:] = it["input_ids"]
        mask[i, length - n:] = 1
        pixels[i, : it["pixel_values"].shape[0]] = it["pixel_values"]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "pixel_values": pixels,
        "image_sizes": torch.stack([it["image_sizes"] for it in items]),
    }


class Stage2Data:
    """Chat examples with their answers, made in pools and batched by length (less padding)."""

    def __init__(self, processor, rng: random.Random, batch_size: int, pool_batches: int = 4):
        self.processor, self.rng, self.batch_size, self.pool_batches = processor, rng, batch_size, pool_batches
        self.tokenizer = processor.tokenizer
        self.queue: list[list[dict]] = []

    def example(self) -> dict:
        pic = make_shape_image(self.rng)
        question = self.rng.choice(QUESTIONS)
        image_first = self.rng.random() >= IMAGE_AFTER_TEXT
        prompt = self.processor.apply_chat_template(user_message(question, image_first), add_generation_prompt=True)
        answer_ids = self.tokenizer(ANSWER.format(colour=pic.colour) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        item = process_one(self.processor, pic.image, prompt + ANSWER.format(colour=pic.colour) + "<|im_end|>")
        if item["input_ids"][-len(answer_ids):].tolist() != answer_ids:
            raise SystemExit("the answer does not tokenize the same on its own and after the prompt")
        item["answer_len"] = len(answer_ids)
        colour_ids = self.tokenizer(" " + pic.colour, add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(answer_ids)) if answer_ids[i: i + len(colour_ids)] == colour_ids]
        if not starts:
            raise SystemExit(f"cannot find the tokens of {pic.colour!r} in the answer")
        item["colour_index"] = starts[0]  # where the colour's first token is in the answer
        return item

    def next_batch(self) -> tuple[dict, torch.Tensor, list[int]]:
        if not self.queue:
            pool = [self.example() for _ in range(self.batch_size * self.pool_batches)]
            pool.sort(key=lambda it: len(it["input_ids"]))
            batches = [pool[i: i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
            self.rng.shuffle(batches)
            self.queue = batches
        items = self.queue.pop()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batch = collate(items, pad_id)
        keep = max(it["answer_len"] for it in items)
        targets = batch["input_ids"][:, -keep:].clone()
        for i, it in enumerate(items):
            targets[i, : keep - it["answer_len"]] = -100
        return batch, targets, [keep - it["answer_len"] + it["colour_index"] for it in items]


# --------------------------------------------------------------------------------------------------
# Stage 1: the vision tower with a probe


class Probe(nn.Module):
    """Attention pooling over all of a picture's features, then colour and shape heads."""

    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.shape = nn.Linear(dim, len(SHAPES))
        self.colour = nn.Linear(dim, len(COLOURS))

    def forward(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = []
        for f in features:  # (tokens, dim)
            weights = torch.softmax(self.score(f).squeeze(-1), dim=0)
            pooled.append(weights @ f)
        p = torch.stack(pooled)
        return self.colour(p), self.shape(p)


def tower_features(model, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> list[torch.Tensor]:
    """Per picture, the selected CLIP features of the tokens the language model will see.

    As `get_image_features` up to the projector: the overview tile's features, then those of the grid's
    tiles with the padding cut away (`pack_image_features`, without image_newline). The padding is
    black, so a probe that saw it could not tell it from a black shape or background.
    """
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    config = model.config
    counts = [
        image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size) for s in image_sizes
    ]
    flat = torch.cat([pv[:n] for pv, n in zip(pixel_values, counts)], dim=0)
    out = model.model.vision_tower(flat, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in config.vision_feature_layer], dim=-1)[:, 1:]
    packed, _ = model.model.pack_image_features(
        torch.split(feats, counts, dim=0), image_sizes, config.vision_feature_select_strategy, image_newline=None
    )
    return packed


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def stage1(model, processor, steps: int, batch_size: int, lr: float, rng: random.Random, shape_weight: float = 0.5) -> None:
    tower = model.model.vision_tower
    probe = Probe(model.config.vision_config.hidden_size * len(VISION_FEATURE_LAYERS))
    params = list(tower.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    colour_index = {c: i for i, c in enumerate(COLOURS)}
    shape_index = {s: i for i, s in enumerate(SHAPES)}
    tower.train()
    seen = right = 0
    for step in range(steps):
        pics = [make_shape_image(rng) for _ in range(batch_size)]
        enc = processor.image_processor(images=[p.image for p in pics], return_tensors="pt")
        colour_logits, shape_logits = probe(tower_features(model, enc["pixel_values"], enc["image_sizes"]))
        colours = torch.tensor([colour_index[p.colour] for p in pics])
        shapes = torch.tensor([shape_index[p.shape] for p in pics])
        loss = nn.functional.cross_entropy(colour_logits, colours)
        if shape_weight:
            loss = loss + shape_weight * nn.functional.cross_entropy(shape_logits, shapes)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=20)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += len(pics)
        right += int((colour_logits.argmax(-1) == colours).sum())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            shape_acc = (shape_logits.argmax(-1) == shapes).float().mean().item()
            log(f"stage 1 step {step + 1}/{steps}: loss {loss.item():.3f}, colour acc (last 50 steps) "
                f"{right / seen:.3f}, shape acc (this batch) {shape_acc:.2f}")
            seen = right = 0


# --------------------------------------------------------------------------------------------------
# Stage 2: through the frozen language model


def stage2(model, processor, steps: int, batch_size: int, lrs: dict[str, float], rng: random.Random) -> None:
    m = model.model
    groups = [
        {"params": list(m.vision_tower.parameters()), "peak": lrs["tower"]},
        {"params": list(m.multi_modal_projector.parameters()) + [m.image_newline], "peak": lrs["projector"]},
    ]
    opt = torch.optim.AdamW([{"params": g["params"], "lr": g["peak"]} for g in groups], weight_decay=0.0)
    params = [p for g in groups for p in g["params"]]
    data = Stage2Data(processor, rng, batch_size)
    model.train()
    model.model.language_model.eval()  # no dropout there anyway; frozen
    losses, seen, right, tokens = [], 0, 0, 0
    step_started = time.perf_counter()
    for step in range(steps):
        batch, targets, colour_cols = data.next_batch()
        keep = targets.shape[1]
        out = model(**batch, logits_to_keep=keep + 1, use_cache=False)
        logits = out.logits[:, :-1]  # position t predicts token t + 1: these predict the last `keep` tokens
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        for g, group in zip(groups, opt.param_groups):
            group["lr"] = cosine_lr(step, steps, g["peak"], warmup=10)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            for i, col in enumerate(colour_cols):
                seen += 1
                right += int(logits[i, col].argmax() == targets[i, col])
        tokens += int(batch["attention_mask"].sum())
        if (step + 1) % 10 == 0 or step + 1 == steps:
            per_step = (time.perf_counter() - step_started) / 10
            log(f"stage 2 step {step + 1}/{steps}: loss {sum(losses) / len(losses):.3f}, colour-token acc "
                f"{right / seen:.2f} (last {len(losses)} steps, teacher-forced), {tokens / len(losses):.0f} tokens/step, "
                f"{per_step:.1f}s/step")
            losses, seen, right, tokens = [], 0, 0, 0
            step_started = time.perf_counter()
    model.eval()


# --------------------------------------------------------------------------------------------------
# Saving, evaluating, README


def clean_config(path: pathlib.Path) -> None:
    """Drop the local path transformers records as text_config's `_name_or_path` (it names this machine's cache)."""
    config = json.loads(path.read_text())
    config.get("text_config", {}).pop("_name_or_path", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_parts(model, processor, base_dir: pathlib.Path, out: pathlib.Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: p.detach().to(torch.float16).contiguous() for k, p in trained_parameters(model).items()}
    embed = model.model.language_model.embed_tokens.weight
    base_vocab = json.loads((base_dir / "config.json").read_text())["vocab_size"]
    tensors[ADDED_EMBEDDINGS] = embed[base_vocab:].detach().to(torch.float16).contiguous()
    # One metadata entry: safetensors writes several in a random order, and the file should not change.
    save_file(tensors, str(out / PARTS_FILE), metadata={"format": "pt"})

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        processor.save_pretrained(tmp_path)
        model.config.save_pretrained(tmp_path)
        clean_config(tmp_path / "config.json")
        for name in ("config.json", "processor_config.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(tmp_path / name, out / name)
        added = [t for t in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"] if t["id"] >= base_vocab]
        (out / TOKENIZER_ADDITIONS).write_text(json.dumps(added, indent=2) + "\n")
    shutil.copyfile(base_dir / "generation_config.json", out / "generation_config.json")


def evaluate(model, processor, n: int, seed: int, batch_size: int = 16) -> tuple[float, list[dict]]:
    rng = random.Random(seed)
    pics = [make_shape_image(rng) for _ in range(n)]
    questions = [rng.choice(QUESTIONS) for _ in range(n)]
    answers = generate_answers(model, processor, [p.image for p in pics], questions, batch_size=batch_size)
    rows = [
        {"colour": p.colour, "shape": p.shape, "size": p.image.size, "question": q, "answer": a,
         "ok": colour_in_answer(a) == p.colour}
        for p, q, a in zip(pics, questions, answers)
    ]
    return sum(r["ok"] for r in rows) / n, rows


def parameter_count(model) -> int:
    return sum(p.numel() for p in trained_parameters(model).values())


def grid_name(size: tuple[int, int]) -> str:
    """The any-resolution grid (height x width) a picture of `size` (width, height) is tiled on."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution((size[1], size[0]), GRID_PINPOINTS)
    return f"{height}x{width}"


def shares(groups: dict[str, list[bool]]) -> str:
    return ", ".join(f"{name} {sum(v) / len(v):.0%} of {len(v)}" for name, v in groups.items() if v)


def image_token_counts(processor, n: int = 400) -> dict:
    """`<image>` tokens per picture over `n` generated pictures: min, max and mean, overall and per grid."""
    counts: dict[str, list[int]] = {}
    rng = random.Random(EVAL_SEED + 1)
    for _ in range(n):
        image = make_shape_image(rng).image
        ids = processor(images=[image], text=[IMAGE_TOKEN], return_tensors="pt")["input_ids"]
        counts.setdefault(grid_name(image.size), []).append(int((ids == processor.image_token_id).sum()))
    every = [c for v in counts.values() for c in v]
    return {
        "min": min(every), "max": max(every), "mean": sum(every) / len(every),
        "per_grid": ", ".join(f"{g}: {min(v)}-{max(v)}" for g, v in sorted(counts.items())),
    }


def machine_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.machine() or "an unknown CPU"


def write_readme(out: pathlib.Path, facts: dict) -> None:
    tokens = facts["tokens"]
    text = f"""# {EXAMPLE_VISION_MODEL_ID}: the trained parts

A tiny vision-language model (LLaVA-NeXT, `LlavaNextForConditionalGeneration`) made in this repo on a
CPU: the embedded SmolLM2-135M-Instruct, frozen and unchanged, as its language model, plus a small CLIP
vision tower, the 2-layer projector and `image_newline`, trained to say the colour of the one shape in a
synthetic picture. It exists to test loraplex's vision path end to end with a real model that runs
anywhere; it is not a general image model.

```
user: <image> What colour is the shape?     assistant: The shape is red.
```

This directory holds only what was trained plus the model's config and processor files (not SmolLM2's
weights). `loraplex.example_models.vision.example_model_dir()` assembles the full transformers-format checkpoint
(config.json, model.safetensors, tokenizer and processor files) from these parts and the embedded model,
once, into loraplex's cache directory, and returns its path; `loraplex serve --model-id
{EXAMPLE_VISION_MODEL_ID}` serves it. `loraplex.example_models.vision.make_shape_image` makes pictures like the
ones it was trained on.

| file | what |
| --- | --- |
| `{PARTS_FILE}` | the trained tensors in float16, named as in the full checkpoint (`vision_tower.*`, `multi_modal_projector.*`, `image_newline`), plus `{ADDED_EMBEDDINGS}`: the embedding row appended for `<image>` |
| `config.json` | the llava_next config (text_config = SmolLM2's, vocab_size {facts["vocab_size"]}) |
| `generation_config.json` | SmolLM2's |
| `processor_config.json`, `chat_template.jinja`, `tokenizer_config.json` | the `LlavaNextProcessor` settings, chat template and tokenizer settings |
| `{TOKENIZER_ADDITIONS}` | the `added_tokens` entry for `<image>` (id {facts["image_token_id"]}), appended to SmolLM2's tokenizer.json |

## The model

- Language model: SmolLM2-135M-Instruct (30 layers, hidden 576), frozen; its vocabulary + `<image>` = {facts["vocab_size"]} tokens.
- Vision tower: CLIP, {VISION["num_hidden_layers"]} layers, hidden {VISION["hidden_size"]}, {VISION["num_attention_heads"]} heads, MLP {VISION["intermediate_size"]}; {IMAGE_SIZE}x{IMAGE_SIZE} tiles of {PATCH_SIZE}x{PATCH_SIZE} patches ({(IMAGE_SIZE // PATCH_SIZE) ** 2} patches + CLS per tile).
- Features: `vision_feature_layer` {VISION_FEATURE_LAYERS} (the outputs of CLIP layers 2 and 4, concatenated: 256 wide), strategy "default" (CLS dropped); projector 256 -> 576 -> 576 (GELU).
- Any resolution: `image_grid_pinpoints` {GRID_PINPOINTS} (height, width). A picture is a 64x64 overview tile plus the 1, 2 or 4 tiles of its best grid, with the padding cut away and `image_newline` after each row of patches: {tokens["min"]} to {tokens["max"]} `<image>` tokens per picture, {tokens["mean"]:.0f} on average over the generator's pictures (per grid: {tokens["per_grid"]}).
- Trained parameters: {facts["trained_params"]:,} (tower {facts["tower_params"]:,}, projector {facts["projector_params"]:,}, image_newline 576). The `<image>` embedding row (576) is the mean of SmolLM2's embeddings and is not trained: image features always replace it. Parts on disk: {facts["parts_bytes"] / 1e6:.1f} MB.
- Chat template: SmolLM2's ChatML (the same default system prompt). A message's content is a string or a list of parts: `{{"type": "image"}}` becomes `<image>\\n` where it stands, `{{"type": "text"}}` its text. The processor expands each `<image>` to the picture's token count.

## How it was made

```
{facts["command"]}
```

Stage 1: the vision tower alone with a throw-away probe (attention pooling, colour and shape heads):
{facts["stage1_steps"]} steps of {facts["stage1_batch"]} pictures. Stage 2: tower, projector and image_newline through the frozen
language model: {facts["stage2_steps"]} steps of {facts["stage2_batch"]} chat examples, loss on the answer tokens only. Pictures from
`loraplex.example_models.vision.make_shape_image`: one circle, square, triangle, diamond or star of one of
{len(COLOURS)} colours ({", ".join(COLOURS)}) on a plain, gradient or two-tone background of other colours,
40-224 pixels a side, aspect ratios up to 1:3. Questions: {len(QUESTIONS)} phrasings ("What colour is the shape?",
"What color is the object in this image?", ...), the picture before the question ({1 - IMAGE_AFTER_TEXT:.0%}) or after it;
answer: "The shape is <colour>.".

Run on {facts["machine"]}, {facts["threads"]} threads, torch {facts["torch"]}, transformers {facts["transformers"]}:
{facts["wall_min"]:.1f} minutes wall clock in all ({facts["cpu_min"]:.1f} CPU minutes): stage 1 {facts["stage1_min"]:.1f} min, stage 2 {facts["stage2_min"]:.1f} min,
saving, assembling and evaluating {facts["eval_min"]:.1f} min. The machine was shared with other jobs; on an idle one
a stage-1 step takes about 0.3 s and a stage-2 step about 3 s.

Evaluation (the end of the script): the full checkpoint assembled from these files, loaded with
`LlavaNextForConditionalGeneration.from_pretrained` and `AutoProcessor.from_pretrained`, greedy
`generate` on {facts["eval_images"]} held-back pictures (seed {EVAL_SEED}, not a training seed): **{facts["accuracy"]:.1%}** of the
answers name the right colour. Per colour: {facts["per_colour"]}. Per grid: {facts["per_grid"]}.

## Limits

- It knows one thing: the colour of the single shape in such synthetic pictures, out of {len(COLOURS)} colour
  names. Photos, several objects, other colours (pink, brown, grey...) or other questions get answers
  that mean nothing; it was never trained to name the shape or to say "I don't know".
- Text-only prompts get SmolLM2-135M-Instruct's own answers (the language model is unchanged).
- Its mistakes are mostly small shapes in long, thin pictures (a 16x16 patch on a 64x64 tile is coarse);
  shapes spanning less than 30% of the picture's shorter side were not in the training data.
- The parts are float16; the assembled checkpoint is float32 (the parts cast up).
"""
    (out / "README.md").write_text(text)


# --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=PARTS_DIR, help=f"where the parts go (default {PARTS_DIR})")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stage1-steps", type=int, default=1000)
    parser.add_argument("--stage1-batch", type=int, default=32)
    parser.add_argument("--stage1-lr", type=float, default=2e-3)
    parser.add_argument("--stage2-steps", type=int, default=200)
    parser.add_argument("--stage2-batch", type=int, default=8)
    parser.add_argument("--projector-lr", type=float, default=1e-3)
    parser.add_argument("--tower-lr", type=float, default=2e-4)
    parser.add_argument("--eval-images", type=int, default=256)
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    torch.manual_seed(SEED)
    import transformers
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    transformers.logging.set_verbosity_error()
    from loraplex.checkpoints.sources import resolve_model

    base_dir = resolve_model(None).path
    processor = build_processor(base_dir)
    model = build_model(base_dir, processor.tokenizer)
    trained = trained_parameters(model)
    log(f"model built: {parameter_count(model):,} trained parameters "
        f"(tower {sum(p.numel() for k, p in trained.items() if k.startswith('vision_tower')):,})")

    rng = random.Random(SEED)
    stage1(model, processor, args.stage1_steps, args.stage1_batch, args.stage1_lr, rng)
    stage1_wall = time.perf_counter() - _STARTED
    stage2(model, processor, args.stage2_steps, args.stage2_batch,
           {"tower": args.tower_lr, "projector": args.projector_lr}, rng)
    train_wall, train_cpu = time.perf_counter() - _STARTED, time.process_time()
    log("training done")

    save_parts(model, processor, base_dir, args.out)
    parts_bytes = sum(f.stat().st_size for f in args.out.iterdir() if f.name != "README.md")
    trained = {k: p.numel() for k, p in trained_parameters(model).items()}
    del model

    with tempfile.TemporaryDirectory(prefix="smollm2-shapes-") as tmp:
        assemble_example_model(tmp, parts_dir=args.out, base_dir=base_dir)
        model = LlavaNextForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(tmp)
        log(f"assembled and loaded the checkpoint from {args.out}; evaluating on {args.eval_images} held-back pictures")
        accuracy, rows = evaluate(model, processor, args.eval_images, EVAL_SEED)
    for r in rows:
        if not r["ok"]:
            log(f"  wrong: {r['colour']} {r['shape']} {r['size']}: {r['question']!r} -> {r['answer']!r}")
    for r in rows[:4]:
        log(f"  e.g. {r['colour']} {r['shape']} {r['size']}: {r['question']!r} -> {r['answer']!r}")
    per_colour = {c: [r["ok"] for r in rows if r["colour"] == c] for c in COLOURS}
    per_grid: dict[str, list[bool]] = {}
    for r in rows:
        per_grid.setdefault(grid_name(r["size"]), []).append(r["ok"])
    wall, cpu = time.perf_counter() - _STARTED, time.process_time()
    log(f"accuracy {accuracy:.1%} on {args.eval_images} held-back pictures; per colour: {shares(per_colour)}")
    log(f"accuracy per grid (height x width): {shares(per_grid)}")
    log(f"total time {wall / 60:.1f} min wall ({cpu / 60:.1f} min cpu); training {train_wall / 60:.1f} min wall "
        f"({train_cpu / 60:.1f} min cpu)")

    argv = " ".join(sys.argv[1:])
    write_readme(args.out, {
        "command": f".venv/bin/python examples/vision/train_vision.py {argv}".rstrip(),
        "vocab_size": len(processor.tokenizer),
        "image_token_id": processor.image_token_id,
        "tokens": image_token_counts(processor),
        "trained_params": sum(trained.values()),
        "tower_params": sum(v for k, v in trained.items() if k.startswith("vision_tower")),
        "projector_params": sum(v for k, v in trained.items() if k.startswith("multi_modal_projector")),
        "parts_bytes": parts_bytes,
        "stage1_steps": args.stage1_steps, "stage1_batch": args.stage1_batch,
        "stage2_steps": args.stage2_steps, "stage2_batch": args.stage2_batch,
        "machine": machine_name(), "threads": args.threads,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "wall_min": wall / 60, "cpu_min": cpu / 60, "stage1_min": stage1_wall / 60,
        "stage2_min": (train_wall - stage1_wall) / 60, "eval_min": (wall - train_wall) / 60,
        "eval_images": args.eval_images, "accuracy": accuracy,
        "per_colour": shares(per_colour), "per_grid": shares(per_grid),
    })
    log(f"wrote {args.out} ({parts_bytes / 1e6:.1f} MB of parts + README.md)")
    if accuracy < args.min_accuracy:
        log(f"FAILED: accuracy {accuracy:.1%} < {args.min_accuracy:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
