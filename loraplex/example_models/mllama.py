"""The example Llama-3.2-Vision-style model: SmolLM2-135M-Instruct with gated cross-attention to a small eye (Mllama).

`loraplex/smollm2-mllama-shapes` is a real, tiny `MllamaForConditionalGeneration` made in this repo: the
embedded SmolLM2-135M-Instruct's 30 decoder layers, frozen and unchanged, are its self-attention layers;
3 new gated cross-attention layers sit between them (text_config.cross_attention_layers, indices into
the combined list of 33); a new small Mllama vision encoder (112x112 tiles of 14x14 patches, at most
2 tiles per picture) and the `multi_modal_projector` feed them. Trained on CPU by
`examples/vision/train_mllama.py` to say the colour of a single shape in a synthetic picture ("What
colour is the shape?" -> "The shape is red."), as `loraplex/smollm2-shapes` (`loraplex.example_models.vision`,
LLaVA-NeXT) is; see `examples/vision/smollm2-mllama-shapes/README.md` for how, its numbers and limits.

Only the trained parts are committed (`examples/vision/smollm2-mllama-shapes/`, a few MB).
`example_mllama_dir()` assembles the full transformers-format checkpoint from them and the embedded
SmolLM2 weights, once, cached as `loraplex.example_models.vision.example_model_dir` is (shared code in
`loraplex.example_models.assembly`): config.json (mllama), model.safetensors (float32, under the names
transformers 5's `save_pretrained` writes for `MllamaForConditionalGeneration`: `language_model.model.*`,
`language_model.lm_head.weight`, `vision_model.*`, `multi_modal_projector.*`), generation_config.json,
tokenizer.json (SmolLM2's plus `<|image|>`), tokenizer_config.json, processor_config.json (a
`MllamaProcessor`) and chat_template.jinja.

Where SmolLM2's tensors go (`base_tensors`): its layer i is the self-attention layer whose combined index
is i plus the number of cross-attention layers before it; each cross-attention layer's feed-forward
(`mlp.*`, frozen in training) is a copy of the SmolLM2 layer just before it; the embeddings get 8 rows
more (Mllama's `embed_tokens` has vocab_size + 8 rows; `<|image|>` is id 49152, the first of them; the
8 rows are the mean of SmolLM2's embeddings and are committed as `added_embed_tokens`); `lm_head` is not
tied to the embeddings (it has 8 rows fewer) and is SmolLM2's embedding matrix.

The parts are found relative to this file (`<repo>/examples/vision/smollm2-mllama-shapes`): from a source
checkout or an editable install, not from a wheel; pass `parts_dir=` to use another copy.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import TYPE_CHECKING, Callable

from loraplex.checkpoints.cache import print_to_stderr
from loraplex.example_models.assembly import (
    ADDED_EMBEDDINGS,
    PARTS_FILE,
    REPO_ROOT,
    ExampleParts,
    check_base_config,
    copy_parts_files,
)

if TYPE_CHECKING:
    import torch

EXAMPLE_MLLAMA_MODEL_ID = "loraplex/smollm2-mllama-shapes"
PARTS_DIR = REPO_ROOT / "examples" / "vision" / "smollm2-mllama-shapes"
IMAGE_TOKEN = "<|image|>"
EXTRA_EMBEDDING_ROWS = 8  # MllamaTextModel: nn.Embedding(vocab_size + 8, hidden_size)
# Bump whenever the assembled output changes for the same parts: it is part of the cache key.
ASSEMBLY_VERSION = "1"
_PARTS = ExampleParts(EXAMPLE_MLLAMA_MODEL_ID, PARTS_DIR, ASSEMBLY_VERSION, "examples/vision/train_mllama.py")

EMBED = "language_model.model.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"
# Checkpoint name -> module name (`MllamaForConditionalGeneration.state_dict()`): transformers 5 loads the
# Llama-3.2-Vision layout through its conversion mapping and save_pretrained writes that layout back.
CHECKPOINT_TO_MODULE = (
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^vision_model\."), "model.vision_model."),
    (re.compile(r"^multi_modal_projector\."), "model.multi_modal_projector."),
)


def module_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name in `MllamaForConditionalGeneration`'s state_dict."""
    for pattern, replacement in CHECKPOINT_TO_MODULE:
        if pattern.match(checkpoint_name):
            return pattern.sub(replacement, checkpoint_name, count=1)
    raise ValueError(f"not a tensor of an Mllama checkpoint: {checkpoint_name!r}")


def base_layers(num_hidden_layers: int, cross_attention_layers: list[int]) -> dict[int, int]:
    """Combined layer index -> the SmolLM2 layer it takes weights from.

    A self-attention layer: all of its weights, SmolLM2's layers in order. A cross-attention layer: its
    feed-forward (`mlp.*`) only, from the SmolLM2 layer just before it (layer 0 if it comes first).
    """
    cross = set(cross_attention_layers)
    if not cross <= set(range(num_hidden_layers)):
        raise ValueError(f"cross_attention_layers {sorted(cross)} are not all below num_hidden_layers {num_hidden_layers}")
    sources, next_base = {}, 0
    for index in range(num_hidden_layers):
        if index in cross:
            sources[index] = max(0, next_base - 1)
        else:
            sources[index] = next_base
            next_base += 1
    return sources


def base_tensors(base_dir: pathlib.Path, text_config: dict) -> dict[str, "torch.Tensor"]:
    """SmolLM2's float32 tensors under the checkpoint names the Mllama model takes them at.

    The embeddings (without Mllama's 8 extra rows: the caller appends them), `lm_head` (a copy of the
    embeddings), the final norm, every self-attention layer and every cross-attention layer's `mlp.*`.
    """
    import torch

    from loraplex.checkpoints.weights import load_state_dict

    state = load_state_dict(base_dir, dtype=torch.float32)
    cross = set(text_config["cross_attention_layers"])
    sources = base_layers(text_config["num_hidden_layers"], text_config["cross_attention_layers"])
    base_count = text_config["num_hidden_layers"] - len(cross)
    tensors = {
        EMBED: state["model.embed_tokens.weight"],
        LM_HEAD: state["model.embed_tokens.weight"].clone(),
        "language_model.model.norm.weight": state["model.norm.weight"],
    }
    layer = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            continue  # lm_head, if the directory has one, is tied to the embeddings in SmolLM2
        m = layer.match(name)
        if m is None or int(m.group(1)) >= base_count:
            raise ValueError(f"unexpected tensor {name!r} in the embedded model {base_dir}")
        by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
    if sorted(by_layer) != list(range(base_count)):
        raise ValueError(f"{base_dir}: expected layers 0..{base_count - 1}, found {sorted(by_layer)}")
    for index, source in sources.items():
        prefix = f"language_model.model.layers.{index}."
        for rest, tensor in by_layer[source].items():
            if index not in cross:
                tensors[prefix + rest] = tensor
            elif rest.startswith("mlp."):
                tensors[prefix + rest] = tensor.clone()  # a copy: the self layer keeps its own
    return tensors


# --------------------------------------------------------------------------------------------------
# Assembling the full checkpoint


def _parts_files(parts_dir: pathlib.Path) -> list[pathlib.Path]:
    return _PARTS.files(parts_dir)


def _cache_key(parts_dir: pathlib.Path, base_dir: pathlib.Path) -> str:
    return _PARTS.cache_key(parts_dir, base_dir)


def example_mllama_dir(
    progress: Callable[[str], None] = print_to_stderr, parts_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """The full transformers-format directory of `loraplex/smollm2-mllama-shapes`, assembled once and cached.

    Loads with `MllamaForConditionalGeneration.from_pretrained(path)` and `AutoProcessor.from_pretrained(path)`.
    The first call (per change of the parts) takes a few seconds plus, on a fresh machine, the embedded
    model's GGUF conversion; later calls only hash the parts.
    """
    return _PARTS.cached_dir(assemble_example_mllama, progress=progress, parts_dir=parts_dir)


def assemble_example_mllama(
    out_dir: str | os.PathLike, parts_dir: str | os.PathLike | None = None, base_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Write the full checkpoint into `out_dir` (an existing, empty directory), uncached; return it.

    `parts_dir` defaults to the committed parts, `base_dir` to the embedded SmolLM2 directory.
    `example_mllama_dir` is this plus the cache; the training script uses it to check what it wrote.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from loraplex.checkpoints.sources import resolve_model

    out = pathlib.Path(out_dir)
    parts = pathlib.Path(parts_dir) if parts_dir is not None else PARTS_DIR
    _parts_files(parts)
    base = pathlib.Path(base_dir) if base_dir is not None else resolve_model(None).path
    config = json.loads((parts / "config.json").read_text())
    text_config = config["text_config"]
    cross = text_config["cross_attention_layers"]
    expected = {key: text_config.get(key) for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                       "num_attention_heads", "num_key_value_heads")}
    expected["num_hidden_layers"] = text_config["num_hidden_layers"] - len(cross)
    check_base_config(base, expected, parts, "the Mllama example")

    tensors = base_tensors(base, text_config)
    with safe_open(str(parts / PARTS_FILE), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name).to(torch.float32)
            if name == ADDED_EMBEDDINGS:
                tensors[EMBED] = torch.cat([tensors[EMBED], tensor], dim=0)
            elif name in tensors:
                raise ValueError(f"{parts / PARTS_FILE}: {name!r} is one of SmolLM2's tensors, not a trained one")
            else:
                tensors[name] = tensor
    rows = tensors[EMBED].shape[0]
    if rows != text_config["vocab_size"] + EXTRA_EMBEDDING_ROWS:
        raise ValueError(f"{parts}: the embeddings have {rows} rows, Mllama wants vocab_size "
                         f"{text_config['vocab_size']} + {EXTRA_EMBEDDING_ROWS}")
    image_token_id = config["image_token_index"]
    if not text_config["vocab_size"] <= image_token_id < rows:
        raise ValueError(f"{parts}: image_token_index {image_token_id} is not one of the added embedding rows")
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_parts_files(parts, base, out)
    return out
