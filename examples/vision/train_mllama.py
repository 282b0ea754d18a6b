"""Train the example Mllama (Llama 3.2 Vision style) model `loraplex/smollm2-mllama-shapes` on CPU, reproducibly.

    .venv/bin/python examples/vision/train_mllama.py                       # the shipped run (~15 min, 2 cores)
    .venv/bin/python examples/vision/train_mllama.py --out /tmp/mllama --stage1-steps 50 --stage2-steps 10 --eval-images 32

What it makes: a `transformers.MllamaForConditionalGeneration` built on the embedded SmolLM2-135M-Instruct
(``loraplex.checkpoints.sources.resolve_model(None)``). SmolLM2's 30 decoder layers become the self-attention
layers, frozen and unchanged; 3 new gated cross-attention layers are inserted after SmolLM2's layers 8,
16 and 24 (`cross_attention_layers` [8, 17, 26] of the 33); a new Mllama vision encoder (4 local layers
+ 1 gated global layer, hidden 128, 112x112 tiles of 14x14 patches, at most 2 tiles: aspect ratios
1x1, 1x2 and 2x1) and the `multi_modal_projector` (the final states and those of local layers 2 and 4,
384 wide, -> 576) give the cross-attention layers 2 x 65 vision states per picture. Each cross layer's
feed-forward is a frozen copy of the SmolLM2 layer before it (`loraplex.example_models.mllama.base_layers`);
its attention, norms and both tanh gates (0 at transformers' init) are trained. The tokenizer gets one
new special token, `<|image|>` (id 49152, the first of Mllama's 8 extra embedding rows; those rows are
the mean of SmolLM2's embeddings and are not trained: the token only marks where the picture is, the
cross-attention mask lets the tokens from it on see the picture). `lm_head` is SmolLM2's embedding
matrix, untied.

Data: synthetic pictures from `loraplex.example_models.vision.make_shape_image` (one shape, one of 8 named
colours, on a plain, gradient or two-tone background of other colours; 40-224 pixels a side, aspect
ratios up to 1:3), generated on the fly from a seeded `random.Random`.

Training, two stages (only the vision encoder, projector and cross layers change):

1. The vision encoder alone, with a throw-away probe (attention pooling + linear heads, as in
   train_vision.py) that names the shape's colour and the shape: cheap (no language model).
2. Encoder, projector and cross-attention layers through the frozen language model: chat-formatted
   questions ("What colour is the shape?" and 6 paraphrases; the picture before the question, now and
   then after it) with the answer "The shape is <colour>." + <|im_end|>; loss on the answer tokens
   only. The gates have their own, larger learning rate: they start at 0.

At the end the parts are written (float16) to --out, the full checkpoint is assembled from them exactly
as `loraplex.example_models.mllama.example_mllama_dir` does (in a temp dir), loaded back with
`MllamaForConditionalGeneration.from_pretrained` + `AutoProcessor.from_pretrained`, and evaluated with
greedy `generate` on --eval-images held-back pictures (another seed): the accuracy is the share of
answers that name the right colour (and no other). The script writes a README.md with the numbers next
to the parts, and exits 1 if the accuracy is under --min-accuracy.

Determinism: as train_vision.py (fixed seeds, seeded data in a fixed order, `torch.set_num_threads`,
`torch.use_deterministic_algorithms(True)`): the same versions on the same kind of CPU with the same
thread count give the same parts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train_vision.py: before torch starts its pool

import torch  # noqa: E402
from torch import nn  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for path in (ROOT, HERE):  # run from a checkout without installing; train_vision.py's helpers
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import train_vision  # noqa: E402  (its helpers, chat template and settings)
from train_vision import (  # noqa: E402
    Probe,
    clean_config,
    cosine_lr,
    log,
    machine_name,
    shares,
)

from loraplex.example_models.assembly import ADDED_EMBEDDINGS, PARTS_FILE, TOKENIZER_ADDITIONS  # noqa: E402
from loraplex.example_models.mllama import (  # noqa: E402
    EMBED,
    EXAMPLE_MLLAMA_MODEL_ID,
    EXTRA_EMBEDDING_ROWS,
    IMAGE_TOKEN,
    PARTS_DIR,
    assemble_example_mllama,
    base_layers,
    base_tensors,
    module_name,
)
from loraplex.example_models.vision import (  # noqa: E402
    ANSWER,
    COLOURS,
    QUESTIONS,
    SHAPES,
    colour_in_answer,
    generate_answers,
    make_shape_image,
    user_message,
)

SEED = 20251202  # model init, training data
EVAL_SEED = 4242  # held-back pictures for the final evaluation (as train_vision.py's)
TILE = 112
PATCH = 14
MAX_TILES = 2
ASPECT_RATIOS = [[1, 1], [1, 2], [2, 1]]  # (tiles high, tiles wide): MllamaImageProcessor's order for 2 tiles
INTERMEDIATE_LAYERS = [1, 3]  # local layers (0-based) whose outputs join the final states
VISION = dict(
    image_size=TILE, patch_size=PATCH, hidden_size=128, attention_heads=4, intermediate_size=512,
    num_hidden_layers=4, num_global_layers=1, intermediate_layers_indices=INTERMEDIATE_LAYERS,
    vision_output_dim=128 * (1 + len(INTERMEDIATE_LAYERS)), max_num_tiles=MAX_TILES,
    supported_aspect_ratios=ASPECT_RATIOS, hidden_act="gelu",
)
CROSS_AFTER = (8, 16, 24)  # a cross-attention layer before each of these SmolLM2 layers
IMAGE_AFTER_TEXT = train_vision.IMAGE_AFTER_TEXT  # share of training prompts with the picture after the question

# train_vision.py's ChatML template (SmolLM2's, same default system prompt), with {"type": "image"}
# rendered as Mllama's `<|image|>` (no newline after it).
CHAT_TEMPLATE = train_vision.CHAT_TEMPLATE.replace("{{ '<image>\\n' }}", "{{ '" + IMAGE_TOKEN + "' }}")
assert CHAT_TEMPLATE != train_vision.CHAT_TEMPLATE


def cross_attention_layers() -> list[int]:
    return [base + k for k, base in enumerate(CROSS_AFTER)]


# --------------------------------------------------------------------------------------------------
# Model, tokenizer, processor


def build_processor(base_dir: pathlib.Path):
    from transformers import AutoTokenizer, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(base_dir, extra_special_tokens={"image_token": IMAGE_TOKEN})
    image_processor = MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=MAX_TILES)
    return MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build_model(base_dir: pathlib.Path, tokenizer):
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaTextConfig, MllamaVisionConfig

    base = json.loads((base_dir / "config.json").read_text())
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_token_id != base["vocab_size"]:
        raise SystemExit(f"{IMAGE_TOKEN} got id {image_token_id}, expected the first free id {base['vocab_size']}")
    heads = base["num_attention_heads"]
    if base.get("head_dim", base["hidden_size"] // heads) * heads != base["hidden_size"]:
        raise SystemExit("Mllama's attention takes head_dim = hidden_size / num_attention_heads; SmolLM2's differs")
    cross = cross_attention_layers()
    text_config = MllamaTextConfig(
        vocab_size=base["vocab_size"], hidden_size=base["hidden_size"], intermediate_size=base["intermediate_size"],
        num_hidden_layers=base["num_hidden_layers"] + len(cross), num_attention_heads=base["num_attention_heads"],
        num_key_value_heads=base["num_key_value_heads"], hidden_act=base["hidden_act"], rms_norm_eps=base["rms_norm_eps"],
        rope_parameters=dict(base["rope_parameters"]), max_position_embeddings=base["max_position_embeddings"],
        cross_attention_layers=cross, bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"], tie_word_embeddings=False,
    )
    config = MllamaConfig(
        vision_config=MllamaVisionConfig(**VISION), text_config=text_config, image_token_index=image_token_id,
    )
    config.architectures = ["MllamaForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = MllamaForConditionalGeneration(config)

    tensors = base_tensors(base_dir, text_config.to_dict())
    embed = tensors[EMBED]
    tensors[EMBED] = torch.cat([embed, embed.mean(dim=0, keepdim=True).expand(EXTRA_EMBEDDING_ROWS, -1)], dim=0)
    missing, unexpected = model.load_state_dict({module_name(k): v for k, v in tensors.items()}, strict=False)
    trained = trained_parameters(model)
    if unexpected or set(missing) != {module_name(k) for k in trained}:
        raise SystemExit(f"loading SmolLM2: unexpected {unexpected[:5]}, missing and not trained "
                         f"{sorted(set(missing) - {module_name(k) for k in trained})[:5]}")
    # Each cross layer's post-feed-forward norm starts as its feed-forward's own (then trains).
    sources = base_layers(text_config.num_hidden_layers, cross)
    layers = model.model.language_model.layers
    with torch.no_grad():
        for index in cross:
            layers[index].post_attention_layernorm.weight.copy_(_base_norm(base_dir, sources[index]))
    model.requires_grad_(False)
    for p in trained.values():
        p.requires_grad_(True)
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    return model


def _base_norm(base_dir: pathlib.Path, layer: int) -> torch.Tensor:
    from safetensors import safe_open

    from loraplex.checkpoints.weights import safetensors_files

    name = f"model.layers.{layer}.post_attention_layernorm.weight"
    for file in safetensors_files(base_dir):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name).to(torch.float32)
    raise SystemExit(f"{base_dir}: no {name}")


def trained_parameters(model) -> dict[str, nn.Parameter]:
    """The parameters training changes, by their names in the saved checkpoint."""
    m = model.model
    named = {f"vision_model.{k}": p for k, p in m.vision_model.named_parameters()}
    named.update({f"multi_modal_projector.{k}": p for k, p in m.multi_modal_projector.named_parameters()})
    for index in m.language_model.cross_attention_layers:
        for k, p in m.language_model.layers[index].named_parameters():
            if not k.startswith("mlp."):
                named[f"language_model.model.layers.{index}.{k}"] = p
    return named


def gate_names(names) -> list[str]:
    return [n for n in names if n.rsplit(".", 1)[-1] in ("cross_attn_attn_gate", "cross_attn_mlp_gate")]


# --------------------------------------------------------------------------------------------------
# Data


class Stage2Data:
    """Batches of chat examples with their answers, through the processor (left-padded)."""

    def __init__(self, processor, rng: random.Random, batch_size: int):
        self.processor, self.rng, self.batch_size = processor, rng, batch_size
        self.tokenizer = processor.tokenizer

    def next_batch(self) -> tuple[dict, torch.Tensor, list[int]]:
        pics = [make_shape_image(self.rng) for _ in range(self.batch_size)]
        texts, answers = [], []
        for pic in pics:
            question = self.rng.choice(QUESTIONS)
            image_first = self.rng.random() >= IMAGE_AFTER_TEXT
            prompt = self.processor.apply_chat_template(user_message(question, image_first), add_generation_prompt=True)
            answer = ANSWER.format(colour=pic.colour) + "<|im_end|>"
            texts.append(prompt + answer)
            answers.append(self.tokenizer(answer, add_special_tokens=False)["input_ids"])
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            enc = self.processor(images=[[p.image] for p in pics], text=texts, return_tensors="pt", padding=True)
        finally:
            self.tokenizer.padding_side = side
        ids = enc["input_ids"]
        keep = max(len(a) for a in answers)
        targets = ids[:, -keep:].clone()
        colour_cols = []
        for i, (pic, answer) in enumerate(zip(pics, answers)):
            if ids[i, ids.shape[1] - len(answer):].tolist() != answer:
                raise SystemExit("the answer does not tokenize the same on its own and after the prompt")
            targets[i, : keep - len(answer)] = -100
            colour_ids = self.tokenizer(" " + pic.colour, add_special_tokens=False)["input_ids"]
            starts = [j for j in range(len(answer)) if answer[j: j + len(colour_ids)] == colour_ids]
            if not starts:
                raise SystemExit(f"cannot find the tokens of {pic.colour!r} in the answer")
            colour_cols.append(keep - len(answer) + starts[0])  # the colour's first token, in `targets`
        mask = enc["attention_mask"]
        batch = {k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values", "aspect_ratio_ids",
                                     "aspect_ratio_mask", "cross_attention_mask")}
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return batch, targets, colour_cols


# --------------------------------------------------------------------------------------------------
# Stage 1: the vision encoder with a probe


def encoder_features(model, enc) -> list[torch.Tensor]:
    """Per picture, the vision encoder's output states (vision_output_dim wide) over its real tiles."""
    states = model.model.vision_model(
        pixel_values=enc["pixel_values"], aspect_ratio_ids=enc["aspect_ratio_ids"],
        aspect_ratio_mask=enc["aspect_ratio_mask"],
    ).last_hidden_state  # (batch, images, tiles, patches + CLS, dim)
    tiles = enc["aspect_ratio_mask"][:, 0].sum(-1).tolist()
    return [states[i, 0, :n].reshape(-1, states.shape[-1]) for i, n in enumerate(tiles)]


def stage1(model, processor, steps: int, batch_size: int, lr: float, rng: random.Random, shape_weight: float = 0.5) -> None:
    encoder = model.model.vision_model
    probe = Probe(model.config.vision_config.vision_output_dim)
    params = list(encoder.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    colour_index = {c: i for i, c in enumerate(COLOURS)}
    shape_index = {s: i for i, s in enumerate(SHAPES)}
    encoder.train()
    seen = right = 0
    for step in range(steps):
        pics = [make_shape_image(rng) for _ in range(batch_size)]
        enc = processor.image_processor(images=[[p.image] for p in pics], return_tensors="pt")
        colour_logits, shape_logits = probe(encoder_features(model, enc))
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
    trained = trained_parameters(model)
    gates = set(gate_names(trained))
    named_groups = {
        "encoder": [p for n, p in trained.items() if n.startswith("vision_model.")],
        "gates": [p for n, p in trained.items() if n in gates],
        "cross": [p for n, p in trained.items() if not n.startswith("vision_model.") and n not in gates],
    }
    groups = [{"params": named_groups[name], "peak": lrs[name]} for name in ("encoder", "cross", "gates")]
    opt = torch.optim.AdamW([{"params": g["params"], "lr": g["peak"]} for g in groups], weight_decay=0.0)
    params = [p for g in groups for p in g["params"]]
    data = Stage2Data(processor, rng, batch_size)
    model.train()
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
            per_step = (time.perf_counter() - step_started) / len(losses)
            gate_values = " ".join(f"{trained[n].item():+.2f}" for n in sorted(gates, key=_layer_order))
            log(f"stage 2 step {step + 1}/{steps}: loss {sum(losses) / len(losses):.3f}, colour-token acc "
                f"{right / seen:.2f} (last {len(losses)} steps, teacher-forced), {tokens / len(losses):.0f} tokens/step, "
                f"{per_step:.1f}s/step; gates (attn, mlp per layer) {gate_values}")
            losses, seen, right, tokens = [], 0, 0, 0
            step_started = time.perf_counter()
    model.eval()


def _layer_order(name: str) -> tuple[int, str]:
    return int(name.split(".")[3]), name


# --------------------------------------------------------------------------------------------------
# Saving, evaluating, README


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


def tiles_name(processor, image) -> str:
    """The tiling MllamaImageProcessor picks for `image`: tiles high x tiles wide."""
    ratio = int(processor.image_processor(images=[[image]], return_tensors="pt")["aspect_ratio_ids"][0, 0])
    high, wide = ASPECT_RATIOS[ratio - 1]
    return f"{high}x{wide}"


def evaluate(model, processor, n: int, seed: int, batch_size: int = 16) -> tuple[float, list[dict]]:
    rng = random.Random(seed)
    pics = [make_shape_image(rng) for _ in range(n)]
    questions = [rng.choice(QUESTIONS) for _ in range(n)]
    answers = generate_answers(model, processor, [[p.image] for p in pics], questions, batch_size=batch_size)
    rows = [
        {"colour": p.colour, "shape": p.shape, "size": p.image.size, "tiles": tiles_name(processor, p.image),
         "question": q, "answer": a, "ok": colour_in_answer(a) == p.colour}
        for p, q, a in zip(pics, questions, answers)
    ]
    return sum(r["ok"] for r in rows) / n, rows


def write_readme(out: pathlib.Path, facts: dict) -> None:
    cross = cross_attention_layers()
    text = f"""# {EXAMPLE_MLLAMA_MODEL_ID}: the trained parts

A tiny Llama-3.2-Vision-style model (Mllama, `MllamaForConditionalGeneration`) made in this repo on a
CPU: the embedded SmolLM2-135M-Instruct's 30 decoder layers, frozen and unchanged, as its self-attention
layers, plus {len(cross)} new gated cross-attention layers, a small Mllama vision encoder and the projector,
trained to say the colour of the one shape in a synthetic picture. It exists to test loraplex's Mllama
path end to end with a real model that runs anywhere; it is not a general image model.

```
user: <|image|>What colour is the shape?     assistant: The shape is red.
```

This directory holds only what was trained plus the model's config and processor files (not SmolLM2's
weights). `loraplex.example_models.mllama.example_mllama_dir()` assembles the full transformers-format checkpoint
(config.json, model.safetensors, tokenizer and processor files) from these parts and the embedded model,
once, into loraplex's cache directory, and returns its path; `loraplex.checkpoints.sources.resolve_model("{EXAMPLE_MLLAMA_MODEL_ID}")`
resolves to it. `loraplex.example_models.vision.make_shape_image` makes pictures like the ones it was trained on.

| file | what |
| --- | --- |
| `{PARTS_FILE}` | the trained tensors in float16, named as in the full checkpoint (`vision_model.*`, `multi_modal_projector.*`, and of the cross-attention layers `language_model.model.layers.<i>.{{cross_attn.*, cross_attn_attn_gate, cross_attn_mlp_gate, input_layernorm.weight, post_attention_layernorm.weight}}`), plus `{ADDED_EMBEDDINGS}`: the {EXTRA_EMBEDDING_ROWS} embedding rows Mllama appends to the vocabulary |
| `config.json` | the mllama config (text_config: SmolLM2's sizes, {facts["num_layers"]} layers, vocab_size {facts["vocab_size"]}, image_token_index {facts["image_token_id"]}) |
| `generation_config.json` | SmolLM2's |
| `processor_config.json`, `chat_template.jinja`, `tokenizer_config.json` | the `MllamaProcessor` settings, chat template and tokenizer settings |
| `{TOKENIZER_ADDITIONS}` | the `added_tokens` entry for `{IMAGE_TOKEN}` (id {facts["image_token_id"]}), appended to SmolLM2's tokenizer.json |

## The model

- Language model: SmolLM2-135M-Instruct's 30 layers (hidden 576, 9 heads, 3 KV heads, MLP 1536, RoPE theta 100000, plain RoPE) as self-attention layers, frozen, with {len(cross)} cross-attention layers inserted before SmolLM2's layers {", ".join(map(str, CROSS_AFTER))}: `cross_attention_layers` {cross} of {facts["num_layers"]}. The self-attention layer at combined index i is SmolLM2's layer i minus the cross layers before it.
- Cross-attention layers: Mllama's (9 query heads, 3 KV heads over the vision states, q/k RMSNorm, tanh gates on the attention and on the feed-forward, 0 at transformers' init). Trained: attention, norms and gates. The feed-forward (`mlp.*`) of each is a frozen copy of the SmolLM2 layer before it (a trained one would add 2.65M parameters per layer to these parts) and is not stored here: the assembly copies it (`loraplex.example_models.mllama.base_layers`). The gates after training (tanh of the attention / feed-forward gate): {facts["gates"]}.
- Embeddings: Mllama's `embed_tokens` has vocab_size + 8 = {facts["vocab_size"] + EXTRA_EMBEDDING_ROWS} rows; `{IMAGE_TOKEN}` is id {facts["image_token_id"]}, the first extra one. The 8 extra rows are the mean of SmolLM2's embeddings, not trained. `lm_head` ({facts["vocab_size"]} rows) is SmolLM2's embedding matrix; it is not tied to `embed_tokens` (transformers never ties them for Mllama), so the assembled checkpoint stores it.
- Vision encoder: Mllama's, {VISION["num_hidden_layers"]} local layers + {VISION["num_global_layers"]} gated global layer, hidden {VISION["hidden_size"]}, {VISION["attention_heads"]} heads, MLP {VISION["intermediate_size"]}, GELU; {TILE}x{TILE} tiles of {PATCH}x{PATCH} patches ({(TILE // PATCH) ** 2} patches + CLS = {(TILE // PATCH) ** 2 + 1} states per tile), at most {MAX_TILES} tiles, `supported_aspect_ratios` {ASPECT_RATIOS} (tiles high, wide). Output: the final states and those of local layers {", ".join(str(i + 1) for i in INTERMEDIATE_LAYERS)} (`intermediate_layers_indices` {INTERMEDIATE_LAYERS}), `vision_output_dim` {VISION["vision_output_dim"]}; projector {VISION["vision_output_dim"]} -> 576. Each picture gives {MAX_TILES} x {(TILE // PATCH) ** 2 + 1} vision states; the cross-attention mask hides the padding tile of a one-tile picture.
- Trained parameters: {facts["trained_params"]:,} (vision encoder {facts["encoder_params"]:,}, projector {facts["projector_params"]:,}, cross-attention layers {facts["cross_params"]:,}). Parts on disk: {facts["parts_bytes"] / 1e6:.1f} MB.
- Processor: `MllamaProcessor` with `MllamaImageProcessor` (size {TILE}x{TILE}, `max_image_tiles` {MAX_TILES}, the default mean/std 0.5) and SmolLM2's tokenizer plus `{IMAGE_TOKEN}`. Chat template: SmolLM2's ChatML (the same default system prompt); a message's content is a string or a list of parts: `{{"type": "image"}}` becomes `{IMAGE_TOKEN}` where it stands, `{{"type": "text"}}` its text. One `{IMAGE_TOKEN}` per picture (cross-attention: no expansion); the tokens from it on see the picture.
- The processor's bos handling: `MllamaProcessor` puts the tokenizer's bos token (SmolLM2's is `<|im_start|>`) in front of a prompt that has none, after any leading `{IMAGE_TOKEN}`s. A chat-templated prompt starts with `<|im_start|>`, so it is left as it is; a raw prompt such as `{IMAGE_TOKEN}What colour?` becomes `{IMAGE_TOKEN}<|im_start|>What colour?`. The tokenizer itself adds no special tokens.

## How it was made

```
{facts["command"]}
```

Stage 1: the vision encoder alone with a throw-away probe (attention pooling over the real tiles' states,
colour and shape heads): {facts["stage1_steps"]} steps of {facts["stage1_batch"]} pictures. Stage 2: encoder, projector and cross-attention
layers through the frozen language model: {facts["stage2_steps"]} steps of {facts["stage2_batch"]} chat examples, loss on the answer tokens
only (learning rates: encoder {facts["lrs"]["encoder"]:g}, cross layers and projector {facts["lrs"]["cross"]:g}, gates {facts["lrs"]["gates"]:g}; cosine). Pictures from
`loraplex.example_models.vision.make_shape_image`: one circle, square, triangle, diamond or star of one of
{len(COLOURS)} colours ({", ".join(COLOURS)}) on a plain, gradient or two-tone background of other colours,
40-224 pixels a side, aspect ratios up to 1:3. Questions: {len(QUESTIONS)} phrasings ("What colour is the shape?",
"What color is the object in this image?", ...), the picture before the question ({1 - IMAGE_AFTER_TEXT:.0%}) or after it;
answer: "The shape is <colour>.".

Run on {facts["machine"]}, {facts["threads"]} threads, torch {facts["torch"]}, transformers {facts["transformers"]}:
{facts["wall_min"]:.1f} minutes wall clock in all ({facts["cpu_min"]:.1f} CPU minutes): stage 1 {facts["stage1_min"]:.1f} min, stage 2 {facts["stage2_min"]:.1f} min,
saving, assembling and evaluating {facts["eval_min"]:.1f} min. The machine was shared with other jobs; while it
was quiet a stage-1 step took about 0.45 s and a stage-2 step about 2.8 s.

Evaluation (the end of the script): the full checkpoint assembled from these files, loaded with
`MllamaForConditionalGeneration.from_pretrained` and `AutoProcessor.from_pretrained`, greedy
`generate` on {facts["eval_images"]} held-back pictures (seed {EVAL_SEED}, not a training seed): **{facts["accuracy"]:.1%}** of the
answers name the right colour. Per colour: {facts["per_colour"]}. Per tiling (tiles high x wide): {facts["per_tiles"]}.

## Limits

- It knows one thing: the colour of the single shape in such synthetic pictures, out of {len(COLOURS)} colour
  names. Photos, several objects, other colours (pink, brown, grey...) or other questions get answers
  that mean nothing; it was never trained to name the shape or to say "I don't know".
- Text-only prompts get SmolLM2-135M-Instruct's own answers: without a picture transformers skips the
  cross-attention layers, and the self-attention layers are SmolLM2's.
- Its mistakes are mostly black: `MllamaImageProcessor` pads a picture to its tile grid with black
  (bottom and right), and the encoder has to tell that padding from a black shape or background.
- Tokens before the picture's `{IMAGE_TOKEN}` (the system prompt, a question asked before the picture) have
  no picture to see; transformers then still adds their cross-attention output over all vision states
  (unmasked), gated, and only zeroes the feed-forward part. The model was trained that way; Meta's
  reference code, vLLM and loraplex zero both, and it answers about as well with that.
- The parts are float16; the assembled checkpoint is float32 (the parts cast up).
"""
    (out / "README.md").write_text(text)


# --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=PARTS_DIR, help=f"where the parts go (default {PARTS_DIR})")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stage1-steps", type=int, default=700)
    parser.add_argument("--stage1-batch", type=int, default=32)
    parser.add_argument("--stage1-lr", type=float, default=2e-3)
    parser.add_argument("--stage2-steps", type=int, default=170)
    parser.add_argument("--stage2-batch", type=int, default=16)
    parser.add_argument("--encoder-lr", type=float, default=5e-4)
    parser.add_argument("--cross-lr", type=float, default=1.5e-3)
    parser.add_argument("--gate-lr", type=float, default=2e-2)
    parser.add_argument("--eval-images", type=int, default=256)
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    torch.manual_seed(SEED)
    import transformers
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    transformers.logging.set_verbosity_error()
    from loraplex.checkpoints.sources import resolve_model

    base_dir = resolve_model(None).path
    processor = build_processor(base_dir)
    model = build_model(base_dir, processor.tokenizer)
    trained = trained_parameters(model)
    log(f"model built: {sum(p.numel() for p in trained.values()):,} trained parameters; cross-attention layers "
        f"{model.config.text_config.cross_attention_layers} of {model.config.text_config.num_hidden_layers}")

    rng = random.Random(SEED)
    stage1(model, processor, args.stage1_steps, args.stage1_batch, args.stage1_lr, rng)
    stage1_wall = time.perf_counter() - train_vision._STARTED
    lrs = {"encoder": args.encoder_lr, "cross": args.cross_lr, "gates": args.gate_lr}
    stage2(model, processor, args.stage2_steps, args.stage2_batch, lrs, rng)
    train_wall, train_cpu = time.perf_counter() - train_vision._STARTED, time.process_time()
    log("training done")

    save_parts(model, processor, base_dir, args.out)
    parts_bytes = sum(f.stat().st_size for f in args.out.iterdir() if f.name != "README.md")
    trained = {k: p.numel() for k, p in trained_parameters(model).items()}
    del model

    with tempfile.TemporaryDirectory(prefix="smollm2-mllama-shapes-") as tmp:
        assemble_example_mllama(tmp, parts_dir=args.out, base_dir=base_dir)
        model = MllamaForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(tmp)
        log(f"assembled and loaded the checkpoint from {args.out}; evaluating on {args.eval_images} held-back pictures")
        accuracy, rows = evaluate(model, processor, args.eval_images, EVAL_SEED)
    layers = model.model.language_model.layers
    gates = ", ".join(f"layer {i}: {layers[i].cross_attn_attn_gate.tanh().item():+.2f} / "
                      f"{layers[i].cross_attn_mlp_gate.tanh().item():+.2f}" for i in cross_attention_layers())
    for r in rows:
        if not r["ok"]:
            log(f"  wrong: {r['colour']} {r['shape']} {r['size']} ({r['tiles']}): {r['question']!r} -> {r['answer']!r}")
    for r in rows[:4]:
        log(f"  e.g. {r['colour']} {r['shape']} {r['size']}: {r['question']!r} -> {r['answer']!r}")
    per_colour = {c: [r["ok"] for r in rows if r["colour"] == c] for c in COLOURS}
    per_tiles: dict[str, list[bool]] = {}
    for r in rows:
        per_tiles.setdefault(r["tiles"], []).append(r["ok"])
    wall, cpu = time.perf_counter() - train_vision._STARTED, time.process_time()
    log(f"accuracy {accuracy:.1%} on {args.eval_images} held-back pictures; per colour: {shares(per_colour)}")
    log(f"accuracy per tiling (high x wide): {shares(per_tiles)}; gates (tanh, attn / mlp): {gates}")
    log(f"total time {wall / 60:.1f} min wall ({cpu / 60:.1f} min cpu); training {train_wall / 60:.1f} min wall "
        f"({train_cpu / 60:.1f} min cpu)")

    argv = " ".join(sys.argv[1:])
    write_readme(args.out, {
        "command": f".venv/bin/python examples/vision/train_mllama.py {argv}".rstrip(),
        "vocab_size": model.config.text_config.vocab_size,
        "num_layers": model.config.text_config.num_hidden_layers,
        "image_token_id": model.config.image_token_id,
        "trained_params": sum(trained.values()),
        "encoder_params": sum(v for k, v in trained.items() if k.startswith("vision_model.")),
        "projector_params": sum(v for k, v in trained.items() if k.startswith("multi_modal_projector.")),
        "cross_params": sum(v for k, v in trained.items() if k.startswith("language_model.")),
        "gates": gates,
        "parts_bytes": parts_bytes,
        "stage1_steps": args.stage1_steps, "stage1_batch": args.stage1_batch,
        "stage2_steps": args.stage2_steps, "stage2_batch": args.stage2_batch, "lrs": lrs,
        "machine": machine_name(), "threads": args.threads,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "wall_min": wall / 60, "cpu_min": cpu / 60, "stage1_min": stage1_wall / 60,
        "stage2_min": (train_wall - stage1_wall) / 60, "eval_min": (wall - train_wall) / 60,
        "eval_images": args.eval_images, "accuracy": accuracy,
        "per_colour": shares(per_colour), "per_tiles": shares(per_tiles),
    })
    log(f"wrote {args.out} ({parts_bytes / 1e6:.1f} MB of parts + README.md)")
    if accuracy < args.min_accuracy:
        log(f"FAILED: accuracy {accuracy:.1%} < {args.min_accuracy:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
