"""Llama 3.2 Vision (transformers' MllamaForConditionalGeneration) as a reference for parity tests: a tiny random
model whose every part visibly matters, the real MllamaProcessor over a word-level tokenizer, transformers'
greedy tokens and prompt logits for one request, and PEFT LoRA adapters over named sets of modules.

The layout follows the real checkpoints:
  * text `vocab_size` (VOCAB, the lm_head rows) counts the ordinary tokens only; `<|image|>` is the next id
    (IMAGE_TOKEN == VOCAB, as 128256 is in Llama 3.2 Vision) and the embedding table has VOCAB + 8 rows;
  * the processor prepends bos itself (`build_string_from_input`) unless the text already holds it, and keeps
    leading `<|image|>` tokens before it: "<|image|>w1" -> [IMAGE_TOKEN, BOS, w1];
  * the cross-attention layers are skipped entirely for a text-only request (no pixel_values).

transformers' own masking differs from Meta's reference (and vLLM's / SGLang's) for the rows before the first
`<|image|>`: transformers zeroes only the cross layers' MLP output on those rows, not the cross-attention output,
and their (all-masked) cross-attention mask row is zeroed, so they attend uniformly to every vision token of every
tile, padding tiles included, and the image leaks into them. `meta_masking=True` (or `meta_row_masking(model)`)
zeroes the attention output too, as Meta does: the rows before the image are then exactly the text-only rows.
Prompts whose image comes first ("<|image|>..." -> no row before it) are the same either way.
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import numpy as np
import torch

from tests.lora.peft_helpers import lora_layers, peft_model

TILE = 28
SELF_LAYERS, CROSS_LAYERS = (0, 2, 4), (1, 3)

# Tokenizer: specials first, then three role words, then "w0".."w244": VOCAB ordinary tokens, `<|image|>` after.
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
ROLES = ("user", "assistant", "system")
VOCAB = 256
PAD, BOS, EOS, UNK, PYTHON_TAG = 0, 1, 2, 3, 4
IMAGE_TOKEN = VOCAB
FIRST_WORD = len(SPECIALS) + len(ROLES)  # id of "w0"
NUM_WORDS = VOCAB - FIRST_WORD

VISION = dict(
    image_size=TILE, patch_size=14, hidden_size=32, attention_heads=4, intermediate_size=64, num_hidden_layers=2,
    num_global_layers=1, intermediate_layers_indices=[1, 0], vision_output_dim=32 * 3, max_num_tiles=2,
    supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
)
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, cross_attention_layers=list(CROSS_LAYERS), max_position_embeddings=512,
    rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)

_L = r"model\.language_model\.layers"
_V = r"model\.vision_model\.(transformer|global_transformer)\.layers\.\d+"
_SELF = "|".join(map(str, SELF_LAYERS))
_CROSS = "|".join(map(str, CROSS_LAYERS))
ADAPTER_TARGETS = {
    # the self-attention decoder layers' projections (not the cross layers, not vision)
    "text": rf"{_L}\.({_SELF})\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    # the cross-attention layers' attention projections (not their MLP)
    "cross": rf"{_L}\.({_CROSS})\.cross_attn\.(q|k|v|o)_proj",
    # the vision encoder's local and global transformers
    "vision": rf"{_V}\.(self_attn\.(q|k|v|o)_proj|mlp\.fc(1|2))",
    "lm_head": r"lm_head",
}
ADAPTER_TARGETS["all"] = "|".join(f"({pattern})" for pattern in ADAPTER_TARGETS.values())
# What the usual target_modules list ALL_PROJECTIONS (q/k/v/o/gate/up/down_proj, matched by suffix) selects on
# this model: every text layer's projections including the cross layers' MLP, the vision attention (not fc1/fc2),
# not lm_head.
ADAPTER_TARGETS["projections"] = r".*\.(q|k|v|o|gate|up|down)_proj"


def word(i: int) -> str:
    return f"w{i}"


def word_id(i: int) -> int:
    return FIRST_WORD + i


def image(height: int, width: int, seed: int) -> np.ndarray:
    """A random uint8 RGB image [height, width, 3]."""
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")


# --------------------------------------------------------------------------------------------------- the model


def tiny_mllama_config(**text_overrides):
    import transformers

    config = transformers.MllamaConfig(
        vision_config=transformers.MllamaVisionConfig(**VISION),
        text_config=transformers.MllamaTextConfig(**{**TEXT, **text_overrides}),
        image_token_index=IMAGE_TOKEN,
    )
    config._attn_implementation = "eager"
    return config


def tiny_mllama(seed: int = 0, **text_overrides):
    """A random eval-mode MllamaForConditionalGeneration whose every part visibly matters: all tanh gates (cross
    attention and cross MLP, tile/position embeddings, global vision layers) well away from 0, norms and biases
    away from 1 and 0, tile and position embeddings at unit scale, the projector scaled so that the vision states
    are as large as the text ones."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.MllamaForConditionalGeneration(tiny_mllama_config(**text_overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            last = name.rsplit(".", 1)[-1]
            if last in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
                p.copy_(torch.rand_like(p) * 0.5 + 0.75)  # tanh in 0.64..0.85
            elif last.startswith("gate"):  # vision: tile / position embedding gates, gate_attn, gate_ffn
                p.copy_(torch.rand_like(p) + 0.3)
            elif "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "tile_embedding" in name or "tile_positional" in name:
                p.normal_()
            if "multi_modal_projector" in name and name.endswith("weight"):
                p.mul_(8.0)
    return model


def save_tiny_mllama(model, processor, path) -> pathlib.Path:
    """The model and the processor as transformers saves them: config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json, processor_config.json, chat_template.jinja.

    transformers writes the original checkpoint names, not its in-memory ones: language_model.model.layers.N...,
    language_model.model.embed_tokens.weight, language_model.lm_head.weight, vision_model...,
    multi_modal_projector... (in memory: model.language_model..., lm_head, model.vision_model...)."""
    path = pathlib.Path(path)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------- the processor


def mllama_tokenizer():
    """A word-level tokenizer: SPECIALS, ROLES, "w0".."w244" (VOCAB ids), then `<|image|>` (IMAGE_TOKEN)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokens = [*SPECIALS, *ROLES, *(word(i) for i in range(NUM_WORDS)), "<|image|>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Added tokens are matched before pre-tokenization: "<s>w1" (as the processor builds it) is [<s>, w1].
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, "<|image|>")])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<|image|>"},
    )


def mllama_processor():
    """The real MllamaProcessor: the word-level tokenizer, MllamaImageProcessor with 28x28 tiles (at most 2 per
    image), and a chat template rendering {"type": "image"} parts as `<|image|>`."""
    import transformers

    images = transformers.MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=2)
    processor = transformers.MllamaProcessor(
        image_processor=images, tokenizer=mllama_tokenizer(), chat_template=CHAT_TEMPLATE
    )
    assert (processor.image_token_id, processor.python_token_id) == (IMAGE_TOKEN, PYTHON_TAG)
    return processor


def hf_inputs(processor, text: str, images=()) -> dict[str, torch.Tensor]:
    """The processor's tensors for ONE request: input_ids, attention_mask [1, T] and, with images, pixel_values
    [1, n, tiles, 3, 28, 28], aspect_ratio_ids [1, n], aspect_ratio_mask [1, n, tiles], cross_attention_mask
    [1, T, n, tiles]. `text` holds one `<|image|>` per image; bos is prepended by the processor."""
    images = list(images)
    out = processor(text=text, images=[images] if images else None, return_tensors="pt")
    return dict(out)


# ------------------------------------------------------------------------------------------------ the reference


@contextlib.contextmanager
def meta_row_masking(model):
    """Within the block, `model`'s cross layers zero the cross-attention output of rows that see no image (Meta's
    reference, vLLM, SGLang), not only their MLP output (transformers)."""
    from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

    handles, masks = [], {}
    for layer in model.modules():
        if not isinstance(layer, MllamaCrossAttentionDecoderLayer):
            continue

        def keep(module, args, kwargs, key=id(layer)):
            masks[key] = kwargs.get("full_text_row_masked_out_mask")

        def apply(module, args, output, key=id(layer)):
            mask = masks.get(key)
            if mask is None:
                return output
            return (mask[:, 0].to(output[0].dtype) * output[0], *output[1:])

        handles.append(layer.register_forward_pre_hook(keep, with_kwargs=True))
        handles.append(layer.cross_attn.register_forward_hook(apply))
    assert handles, "no MllamaCrossAttentionDecoderLayer in the model"
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _on(model, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`inputs` on the model's device, pixel values in its dtype."""
    dtype = next(model.parameters()).dtype
    return {k: v.to(model.device, dtype) if v.is_floating_point() else v.to(model.device) for k, v in inputs.items()}


def _masking(model, meta_masking: bool):
    return meta_row_masking(model) if meta_masking else contextlib.nullcontext()


@torch.inference_mode()
def hf_greedy(
    model, processor, text: str, images=(), max_new_tokens: int = 8, meta_masking: bool = False, **generate_kwargs
) -> list[int]:
    """transformers' greedy tokens for one request, exactly `max_new_tokens` of them (EOS is no stop);
    `generate_kwargs` go to `generate` (a repetition penalty, ...)."""
    inputs = _on(model, hf_inputs(processor, text, images))
    prompt_len = inputs["input_ids"].shape[1]
    with _masking(model, meta_masking):
        out = model.generate(
            **inputs, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            eos_token_id=None, pad_token_id=PAD, **generate_kwargs,
        )
    generated = out[0, prompt_len:].tolist()
    assert len(generated) == max_new_tokens, f"generate stopped early: {generated}"
    return generated


@torch.inference_mode()
def hf_logits(model, processor, text: str, images=(), meta_masking: bool = False) -> torch.Tensor:
    """transformers' logits at every prompt position [T, VOCAB], float32."""
    with _masking(model, meta_masking):
        return model(**_on(model, hf_inputs(processor, text, images)), use_cache=False).logits[0].float().cpu()


# ------------------------------------------------------------------------------------------------------ PEFT


def mllama_peft_adapter(model, target_modules, path=None, seed: int = 0, rank: int = 4, alpha: int = 8,
                        strength: float = 0.5):
    """A PEFT LoRA model over a deep copy of `model` (never modified) on `target_modules` (a list of names or
    suffixes, or a regex PEFT full-matches against module names such as ADAPTER_TARGETS'), with random A and B
    sized so that every module's delta is about `strength` times its input's rms; saved to `path` (adapter_config.json
    and adapter_model.safetensors) when given.

    PEFT saves under the in-memory names ("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A
    .weight"), unlike the model checkpoint; with lm_head targeted it also saves the base lm_head weight
    ("base_model.model.lm_head.base_layer.weight": PEFT counts lm_head as an embedding layer)."""
    lora = peft_model(model, seed, strength, r=rank, lora_alpha=alpha, target_modules=target_modules)
    if path is not None:
        lora.save_pretrained(str(path))
    return lora


def adapted_modules(lora_model) -> list[str]:
    """The base model's module names PEFT put LoRA on (adapter "default"), sorted."""
    return sorted(lora_layers(lora_model))


def expected_modules(model, target: str) -> list[str]:
    """The Linear modules of `model` a regex of ADAPTER_TARGETS full-matches, sorted."""
    pattern = re.compile(ADAPTER_TARGETS.get(target, target))
    return sorted(
        name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name)
    )


# ------------------------------------------------------------------------------------------------ ours


def pictures(sizes, seed: int) -> list[np.ndarray]:
    """Random pictures of the given (height, width) sizes."""
    return [image(h, w, seed * 10 + i) for i, (h, w) in enumerate(sizes)]


def request_inputs(processor, text: str, images) -> tuple[list[int], "ImageInputs | None"]:
    """Token ids and the engine's image inputs for one request, as the server's processor path makes them."""
    from loraplex.multimodal.image_inputs import ImageInputs

    out = hf_inputs(processor, text, images)
    ids = out["input_ids"][0].tolist()
    if not len(images):
        return ids, None
    return ids, ImageInputs.from_processor(out, [im.shape[:2] for im in images], IMAGE_TOKEN)


def tiny_pair(path) -> tuple:
    """(transformers model, processor, our model, our config): `tiny_mllama(seed=0)` saved to `path` and loaded
    as loraplex loads a checkpoint directory."""
    from tests.helpers import load_saved

    hf, processor = tiny_mllama(seed=0), mllama_processor()
    return hf, processor, *load_saved(save_tiny_mllama(hf, processor, path))
