"""The example vision-language model: SmolLM2-135M-Instruct with a small trained CLIP eye (LLaVA-NeXT).

`loraplex/smollm2-shapes` is a real, tiny `LlavaNextForConditionalGeneration` made in this repo: the
embedded SmolLM2-135M-Instruct (frozen, unchanged) as its language model, plus a 4-layer CLIP vision
tower, the 2-layer projector and `image_newline`, trained on CPU by `examples/vision/train_vision.py` to
say the colour of a single shape in a synthetic picture ("What colour is the shape?" -> "The shape is
red."). See `examples/vision/smollm2-shapes/README.md` for how it was made, its numbers and its limits.

Only the trained parts are committed (`examples/vision/smollm2-shapes/`, a few MB). `example_model_dir()`
assembles the full transformers-format checkpoint from them and the embedded SmolLM2 weights
(`loraplex.checkpoints.sources.resolve_model(None)`): config.json (llava_next), model.safetensors (float32, the
tensor names `save_pretrained` writes for llava_next: `language_model.model.*`, `vision_tower.*`,
`multi_modal_projector.*`, `image_newline`; `lm_head` is tied to the embeddings and not stored),
generation_config.json, tokenizer.json (SmolLM2's plus the `<image>` token), tokenizer_config.json,
processor_config.json and chat_template.jinja. It is written once (to a temp dir, then renamed) under
loraplex's cache dir (`$LORAPLEX_CACHE`, else the platform's user cache dir) in
`vision/smollm2-shapes-<key>`, where the key hashes the parts' files, the SmolLM2 directory it was built
from and `ASSEMBLY_VERSION`; changed parts give a new directory.

The parts are found relative to this file: `<repo>/examples/vision/smollm2-shapes`, so this works from
a source checkout (or an editable install), not from a wheel (the wheel does not ship `examples/`);
pass `parts_dir=` to use another copy.

The picture generator the model was trained on lives here too (`make_shape_image`), so that tests and
demos can make pictures the model knows how to read.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from loraplex.checkpoints.cache import print_to_stderr
from loraplex.example_models.assembly import (  # noqa: F401  (PARTS_FILE & co: this model's names, re-exported)
    ADDED_EMBEDDINGS,
    COPIED_FILES,
    PARTS_FILE,
    REPO_ROOT,
    TOKENIZER_ADDITIONS,
    ExampleParts,
    check_base_config,
    copy_parts_files,
)

if TYPE_CHECKING:  # PIL is imported where pictures are made, not when this module is imported
    from PIL import Image

EXAMPLE_VISION_MODEL_ID = "loraplex/smollm2-shapes"
PARTS_DIR = REPO_ROOT / "examples" / "vision" / "smollm2-shapes"
# Bump whenever the assembled output changes for the same parts: it is part of the cache key.
ASSEMBLY_VERSION = "1"
_PARTS = ExampleParts(EXAMPLE_VISION_MODEL_ID, PARTS_DIR, ASSEMBLY_VERSION, "examples/vision/train_vision.py")

# --------------------------------------------------------------------------------------------------
# The pictures: one shape of one named colour on a background of other colours

# Named colours (RGB) the model answers with; each pair is far apart.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (35, 65, 225),
    "yellow": (245, 220, 25),
    "purple": (135, 45, 175),
    "orange": (250, 135, 20),
    "black": (15, 15, 15),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle", "diamond", "star")
QUESTIONS = (
    "What colour is the shape?",
    "What color is the shape?",
    "What colour is the shape in the picture?",
    "What color is the object in this image?",
    "Which colour is the shape?",
    "Tell me the colour of the shape.",
    "What is the color of the shape?",
)
ANSWER = "The shape is {colour}."

_JITTER = 18  # per channel, on the shape's colour
_MIN_BACKGROUND_DISTANCE = 110.0  # RGB distance of every background colour from the shape's colour


@dataclass(frozen=True)
class ShapeImage:
    image: "Image.Image"  # RGB
    colour: str  # a key of COLOURS
    shape: str  # one of SHAPES


def _distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5


def _nearest_named(rgb: tuple[int, ...]) -> str:
    return min(COLOURS, key=lambda name: _distance(rgb, COLOURS[name]))


def _background_colour(rng: random.Random, colour: str, shape_rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """A random colour that is neither close to the shape's colour nor nearest to its named colour."""
    while True:
        if rng.random() < 0.3:  # now and then another named colour, so the model must find the shape
            name = rng.choice([c for c in COLOURS if c != colour])
            rgb = tuple(min(255, max(0, v + rng.randint(-_JITTER, _JITTER))) for v in COLOURS[name])
        else:
            rgb = (rng.randint(0, 255), rng.randint(0, 255), rng.randint(0, 255))
        if _distance(rgb, shape_rgb) >= _MIN_BACKGROUND_DISTANCE and _nearest_named(rgb) != colour:
            return rgb  # type: ignore[return-value]


def _shape_points(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if shape == "square":
        corners = [(angle + math.pi / 4 + k * math.pi / 2) for k in range(4)]
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in corners]
    if shape == "diamond":  # a rhombus, taller than wide
        return [(cx, cy - r), (cx + 0.65 * r, cy), (cx, cy + r), (cx - 0.65 * r, cy)]
    if shape == "triangle":
        corners = [(angle - math.pi / 2 + k * 2 * math.pi / 3) for k in range(3)]
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in corners]
    if shape == "star":
        points = []
        for k in range(10):
            a = angle - math.pi / 2 + k * math.pi / 5
            radius = r if k % 2 == 0 else 0.45 * r
            points.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
        return points
    raise ValueError(f"unknown shape {shape!r}")


def make_shape_image(
    rng: random.Random, colour: str | None = None, shape: str | None = None, size: tuple[int, int] | None = None,
) -> ShapeImage:
    """One picture: a `shape` of `colour` (random if None) on a plain, gradient or two-tone background.

    Sizes (width, height) are random between 40 and 224 pixels: a quarter small, half wide or tall
    (aspect 1.6-3), a quarter large and square-ish, so every grid of the any-resolution tiling is used.
    The shape spans 30-75% of the shorter side, anywhere in the picture (wholly inside it); squares,
    triangles and stars are rotated at random. Deterministic for a given `rng` state.
    """
    from PIL import Image, ImageDraw

    colour = colour if colour is not None else rng.choice(list(COLOURS))
    shape = shape if shape is not None else rng.choice(SHAPES)
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r}; known: {', '.join(COLOURS)}")
    if size is None:
        kind = rng.random()
        if kind < 0.25:  # small: mostly the 64x64 grid
            size = (rng.randint(40, 72), rng.randint(40, 72))
        elif kind < 0.75:  # wide or tall (aspect 1.6-3): the 64x128 and 128x64 grids
            short = rng.randint(40, 90)
            long = min(224, round(short * rng.uniform(1.6, 3.0)))
            size = (long, short) if kind < 0.5 else (short, long)
        else:  # large, square-ish: the 128x128 grid
            side = rng.randint(90, 224)
            size = (side, min(224, max(40, round(side * rng.uniform(0.8, 1.25)))))
    width, height = size
    shape_rgb = tuple(min(255, max(0, v + rng.randint(-_JITTER, _JITTER))) for v in COLOURS[colour])

    first = _background_colour(rng, colour, shape_rgb)  # type: ignore[arg-type]
    style = rng.random()
    image = Image.new("RGB", (width, height), first)
    if style >= 0.5:  # half plain; else a linear gradient (35%) or two tones (15%) of two allowed colours
        second = _background_colour(rng, colour, shape_rgb)  # type: ignore[arg-type]
        horizontal = rng.random() < 0.5
        steps = width if horizontal else height
        draw = ImageDraw.Draw(image)
        two_tone = style >= 0.85
        split = rng.randint(steps // 4, 3 * steps // 4)
        for i in range(steps):
            if two_tone:
                rgb = first if i < split else second
            else:
                t = i / max(1, steps - 1)
                rgb = tuple(round(a + (b - a) * t) for a, b in zip(first, second))
            box = (i, 0, i, height - 1) if horizontal else (0, i, width - 1, i)
            draw.rectangle(box, fill=rgb)

    short = min(width, height)
    r = rng.uniform(0.15, 0.375) * short  # radius: the shape spans 30-75% of the shorter side
    cx = rng.uniform(r + 1, width - r - 1)
    cy = rng.uniform(r + 1, height - r - 1)
    angle = rng.uniform(-math.pi / 6, math.pi / 6)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=shape_rgb)
    else:
        draw.polygon(_shape_points(shape, cx, cy, r, angle), fill=shape_rgb)
    return ShapeImage(image=image, colour=colour, shape=shape)


def colour_in_answer(answer: str) -> str | None:
    """The one named colour an answer mentions (None if none or several): how answers are scored."""
    words = {w.strip(".,!?;:'\"()").lower() for w in answer.split()}
    found = [c for c in COLOURS if c in words]
    return found[0] if len(found) == 1 else None


def user_message(question: str, image_first: bool = True) -> list[dict]:
    """The chat messages that ask `question` about one picture (an image part, then the text part)."""
    parts = [{"type": "image"}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts if image_first else parts[::-1]}]


def generate_answers(
    model, processor, images: list, questions: list[str], max_new_tokens: int = 12, batch_size: int = 16,
) -> list[str]:
    """Greedy answers of a transformers image-text `model` to one question per picture (the reference path).

    For LLaVA-NeXT `images` are pictures; for Mllama (`loraplex.example_models.mllama`), whose processor takes
    a list of pictures per prompt, one-picture lists. Prompts go through the processor's chat template
    (default system prompt, generation prompt added); batches are left-padded.
    """
    import torch

    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    answers: list[str] = []
    try:
        for start in range(0, len(images), batch_size):
            chunk = slice(start, start + batch_size)
            prompts = [
                processor.apply_chat_template(user_message(q), add_generation_prompt=True) for q in questions[chunk]
            ]
            inputs = processor(images=images[chunk], text=prompts, return_tensors="pt", padding=True).to(model.device)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            new = out[:, inputs["input_ids"].shape[1]:]
            answers += [a.strip() for a in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return answers


# --------------------------------------------------------------------------------------------------
# Assembling the full checkpoint


def _parts_files(parts_dir: pathlib.Path) -> list[pathlib.Path]:
    return _PARTS.files(parts_dir)


def _cache_key(parts_dir: pathlib.Path, base_dir: pathlib.Path) -> str:
    return _PARTS.cache_key(parts_dir, base_dir)


def example_model_dir(
    progress: Callable[[str], None] = print_to_stderr, parts_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """The full transformers-format directory of `loraplex/smollm2-shapes`, assembled once and cached.

    Loads with `LlavaNextForConditionalGeneration.from_pretrained(path)` and
    `AutoProcessor.from_pretrained(path)`. The first call (per change of the parts) takes a few seconds
    plus, on a fresh machine, the embedded model's GGUF conversion; later calls only hash the parts.
    """
    return _PARTS.cached_dir(assemble_example_model, progress=progress, parts_dir=parts_dir)


def assemble_example_model(
    out_dir: str | os.PathLike, parts_dir: str | os.PathLike | None = None, base_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Write the full checkpoint into `out_dir` (an existing, empty directory), uncached; return it.

    `parts_dir` defaults to the committed parts, `base_dir` to the embedded SmolLM2 directory.
    `example_model_dir` is this plus the cache; the training script uses it to check what it wrote.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from loraplex.checkpoints.sources import resolve_model
    from loraplex.checkpoints.weights import load_state_dict

    out = pathlib.Path(out_dir)
    parts = pathlib.Path(parts_dir) if parts_dir is not None else PARTS_DIR
    _parts_files(parts)
    base = pathlib.Path(base_dir) if base_dir is not None else resolve_model(None).path
    config = json.loads((parts / "config.json").read_text())
    text_config = config["text_config"]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    check_base_config(base, {key: text_config.get(key) for key in keys}, parts, "the vision example")

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_state_dict(base, dtype=torch.float32).items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings (tie_word_embeddings), as save_pretrained leaves it out
        if not name.startswith("model."):
            raise ValueError(f"unexpected tensor {name!r} in the embedded model {base}")
        tensors["language_model." + name] = tensor
    with safe_open(str(parts / PARTS_FILE), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name).to(torch.float32)
            if name == ADDED_EMBEDDINGS:
                embed = "language_model.model.embed_tokens.weight"
                tensors[embed] = torch.cat([tensors[embed], tensor], dim=0).contiguous()
            else:
                tensors[name] = tensor.contiguous()
    vocab = tensors["language_model.model.embed_tokens.weight"].shape[0]
    if vocab != text_config["vocab_size"]:
        raise ValueError(f"{parts}: embeddings have {vocab} rows, config.json says vocab_size {text_config['vocab_size']}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_parts_files(parts, base, out)
    return out
