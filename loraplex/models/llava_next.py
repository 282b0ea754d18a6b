"""LLaVA-NeXT and LLaVA 1.5: a CLIP vision tower, a two-layer projector and a Llama-family language model.

Parameter names match transformers 5's `LlavaNextForConditionalGeneration` and `LlavaForConditionalGeneration`
(PEFT adapters name modules that way): `model.vision_tower.*` (models/clip.py),
`model.multi_modal_projector.linear_{1,2}`, `model.image_newline` (LLaVA-NeXT only),
`model.language_model.*` (our `LlamaModel`), `lm_head`. `checkpoint_name` maps the layouts checkpoints
are saved in (transformers 4's llava-hf layout included) onto them.

Images, LLaVA-NeXT ("any resolution"): the processor resizes each image to the best of
`image_grid_pinpoints`, cuts it into square tiles and prepends a base tile of the whole image.
`encode_images` runs all tiles of all images through the tower and projector in one batch, then packs
each image: its base tile's features, then the grid's features laid out as one picture, cropped back to
the image's aspect ratio ("unpadded"), each row of features followed by `image_newline`. That is the
order of the image's placeholder tokens in the prompt.

Images, LLaVA 1.5 (single resolution: a config without `image_grid_pinpoints`): the processor resizes and
centre-crops each image to one tile; its features are its placeholders' ((image_size / patch_size)^2,
576 for 336/14; one more with the "full" strategy, which keeps CLIP's CLS). The image's size is not read.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from loraplex.models.config import ModelConfig, VisionConfig
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.models.clip import VISION_ACTIVATIONS, CLIPVisionModel
from loraplex.models.hf_config import normalised, require
from loraplex.models.llama import LLAMA_FAMILY, LlamaModel, llama_config_from_hf

ImageSize = tuple[int, int]  # (height, width) in pixels

# Checkpoint name -> module name. transformers (4 and 5) saves `language_model.model.*`,
# `language_model.lm_head.*` and top-level `vision_tower.*`, `multi_modal_projector.*`, `image_newline`;
# transformers 4's CLIP nested its tower under `vision_model`. In-memory names pass unchanged.
_CHECKPOINT_RENAMES = [
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^(vision_tower|multi_modal_projector|image_newline)\b"), r"model.\1"),
    (re.compile(r"^model\.vision_tower\.vision_model\."), "model.vision_tower."),
]


def best_resolution(size: ImageSize, pinpoints: tuple[ImageSize, ...]) -> ImageSize:
    """The pinpoint (height, width) that keeps most of the image's pixels once it is scaled to fit, the
    least wasted area breaking ties (LLaVA-NeXT's rule; the processor resizes to the same one)."""
    height, width = size
    best, most_kept, least_wasted = pinpoints[0], -1, float("inf")
    for fit_height, fit_width in pinpoints:
        scale = min(fit_width / width, fit_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = fit_width * fit_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (fit_height, fit_width), kept, wasted
    return best


def grid_shape(size: ImageSize, vision: VisionConfig) -> tuple[int, int]:
    """(rows, cols) of tiles the image is cut into, besides its base tile."""
    height, width = best_resolution(size, vision.image_grid_pinpoints)
    return height // vision.image_size, width // vision.image_size


def unpadded_region(size: ImageSize, grid_height: int, grid_width: int) -> tuple[int, int, int, int]:
    """The image's area inside a grid of features that holds it scaled to fit and centred (the
    processor pads the rest): (first row, last row + 1, first col, last col + 1)."""
    height, width = size
    if width / height > grid_width / grid_height:  # wider than the grid: padded above and below
        kept = int(round(height * (grid_width / width), 7))
        pad = (grid_height - kept) // 2
        return pad, grid_height - pad, 0, grid_width
    kept = int(round(width * (grid_height / height), 7))
    pad = (grid_width - kept) // 2
    return 0, grid_height, pad, grid_width - pad


class LlavaNextMultiModalProjector(nn.Module):
    def __init__(self, config: ModelConfig, vision: VisionConfig) -> None:
        super().__init__()
        features = vision.hidden_size * len(vision.feature_layers)  # several layers are concatenated
        bias = vision.multimodal_projector_bias
        self.linear_1 = nn.Linear(features, config.hidden_size, bias=bias)
        self.linear_2 = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.act = VISION_ACTIVATIONS[vision.projector_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaNextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.vision is not None, "a llava_next config has a vision part"
        self.vision_tower = CLIPVisionModel(config.vision)
        self.multi_modal_projector = LlavaNextMultiModalProjector(config, config.vision)
        if config.vision.image_grid_pinpoints:  # any resolution: ends each row of grid features
            self.image_newline = nn.Parameter(torch.empty(config.hidden_size))
        self.language_model = LlamaModel(config)


class LlavaNextForConditionalGeneration(nn.Module, ModelFamily):
    inputs = ModelInputs.TEXT | ModelInputs.IMAGE_FEATURES
    linear_rows = (("model.vision_tower.*", "patches"), ("model.multi_modal_projector.*", "patches"))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.vision is not None, "a llava_next config has a vision part"
        self.config, self.vision = config, config.vision
        self.any_resolution = bool(config.vision.image_grid_pinpoints)  # False: LLaVA 1.5, one tile per image
        self.model = LlavaNextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The module name a checkpoint tensor fills (weights.load_into asks)."""
        for pattern, replacement in _CHECKPOINT_RENAMES:
            name = pattern.sub(replacement, name)
        return name

    # ---- language model

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- images

    def tiles_per_image(self, image_sizes: list[ImageSize]) -> list[int]:
        """Tiles (base + grid) of each image in the processor's pixel_values; the rest is padding.
        Single resolution: one each, whatever the sizes."""
        if not self.any_resolution:
            return [1] * len(image_sizes)
        return [rows * cols + 1 for rows, cols in (grid_shape(s, self.vision) for s in _sizes(image_sizes))]

    def encode_images(
        self, pixel_values: torch.Tensor, image_sizes: list[ImageSize] | None = None
    ) -> list[torch.Tensor]:
        """Per image, its features [placeholder tokens, hidden] in the order of its placeholders.

        `pixel_values` [images, max_tiles, 3, H, W] as LlavaNextImageProcessor pads it (single resolution:
        [images, 1, 3, H, W], and `image_sizes` is not needed). The real tiles of all images go through the
        tower and projector as one [tiles, tokens, features] batch, each image's tiles contiguous and in
        the given order.
        """
        if pixel_values.dim() != 5:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected [images, tiles, 3, H, W]")
        if not self.any_resolution:
            return list(self._features(pixel_values[:, 0]))  # one tile per image: its features, in patch order
        if image_sizes is None:
            raise ValueError("any-resolution images need their sizes (image_sizes)")
        sizes = _sizes(image_sizes)
        if not sizes:
            return []
        counts = self.tiles_per_image(sizes)
        if pixel_values.shape[0] != len(sizes):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected [{len(sizes)}, tiles, 3, H, W]")
        for i, count in enumerate(counts):
            if pixel_values.shape[1] < count:
                have = pixel_values.shape[1]
                raise ValueError(f"image {i} of size {sizes[i]} needs {count} tiles; pixel_values has {have}")
        features = self._features(torch.cat([pixel_values[i, :count] for i, count in enumerate(counts)]))
        return [self._pack(f, size) for f, size in zip(features.split(counts), sizes)]

    def _features(self, tiles: torch.Tensor) -> torch.Tensor:
        """Tiles [tiles, 3, H, W] -> projected features [tiles, patches (+ CLS with "full"), hidden]."""
        weight = self.model.vision_tower.embeddings.patch_embedding.weight
        states = self.model.vision_tower(tiles.to(weight.device, weight.dtype), self.vision.feature_layers)
        if self.vision.vision_feature_select_strategy == "default":
            states = states[:, 1:]  # drop CLS
        return self.model.multi_modal_projector(states)

    def _pack(self, tiles: torch.Tensor, size: ImageSize) -> torch.Tensor:
        """One image's tile features [tiles, patches, hidden] -> its placeholder features [n, hidden]."""
        base, grid = tiles[0], tiles[1:]
        side = self.vision.image_size // self.vision.patch_size  # patches per tile side
        rows, cols = grid_shape(size, self.vision)
        hidden = grid.shape[-1]
        # Tiles row by row, patches row by row within a tile -> one [rows * side, cols * side] picture.
        picture = grid.reshape(rows, cols, side, side, hidden).permute(0, 2, 1, 3, 4)
        picture = picture.reshape(rows * side, cols * side, hidden)
        top, bottom, left, right = unpadded_region(size, rows * side, cols * side)
        picture = picture[top:bottom, left:right]
        newline = self.model.image_newline.to(picture.dtype).expand(picture.shape[0], 1, hidden)
        return torch.cat([base, torch.cat([picture, newline], dim=1).reshape(-1, hidden)])


def _sizes(image_sizes) -> list[ImageSize]:
    """(height, width) pairs of plain ints (a processor's image_sizes tensor included)."""
    if isinstance(image_sizes, torch.Tensor):
        image_sizes = image_sizes.tolist()
    return [(int(h), int(w)) for h, w in image_sizes]


def llava_next_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """LLaVA-NeXT: the decoder fields come from `text_config` (so KV cache sizing is the Llama one's),
    the image path from `vision_config` and the top level."""
    from transformers import LlavaNextConfig  # configs only: it fills in the defaults

    return _llava_config_from_hf(hf, LlavaNextConfig, any_resolution=True)


def llava_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """LLaVA 1.5: as LLaVA-NeXT, with one tile per image (no pinpoints, no `image_newline`)."""
    from transformers import LlavaConfig

    return _llava_config_from_hf(hf, LlavaConfig, any_resolution=False)


def _llava_config_from_hf(hf: dict[str, Any], config_class, any_resolution: bool) -> ModelConfig:
    model_type = config_class.model_type
    try:  # llava-hf configs saved by transformers 4 omit every text/vision field left at its default
        full = config_class.from_dict(hf).to_dict()
    except Exception as e:
        raise ValueError(f"invalid {model_type} config: {e}") from e
    text, vision = full["text_config"], full["vision_config"]
    if text.get("model_type") not in LLAMA_FAMILY:
        supported = ", ".join(LLAMA_FAMILY)
        raise ValueError(f"unsupported text_config.model_type {text.get('model_type')!r}; supported: {supported}")
    image_size, num_layers = vision["image_size"], vision["num_hidden_layers"]
    layer = full["vision_feature_layer"]
    layers = (layer,) if isinstance(layer, int) else tuple(layer)
    token = hf.get("image_token_id", full.get("image_token_index"))
    pinpoints = tuple(tuple(p) for p in full.get("image_grid_pinpoints") or ()) if any_resolution else ()
    strategy, projector_act = full["vision_feature_select_strategy"], full["projector_hidden_act"]

    require("vision_config.model_type", vision.get("model_type"), vision.get("model_type") == "clip_vision_model",
            "supported: clip_vision_model")
    require("vision_config.image_size", image_size, image_size % vision["patch_size"] == 0,
            f"not a multiple of patch_size {vision['patch_size']}")
    require("vision_config.num_attention_heads", vision["num_attention_heads"],
            vision["hidden_size"] % vision["num_attention_heads"] == 0, "does not divide hidden_size")
    require("vision_config.hidden_act", vision["hidden_act"], vision["hidden_act"] in VISION_ACTIVATIONS,
            f"supported: {', '.join(VISION_ACTIVATIONS)}")
    require("projector_hidden_act", projector_act, projector_act in VISION_ACTIVATIONS,
            f"supported: {', '.join(VISION_ACTIVATIONS)}")
    # "full" keeps CLIP's CLS token, which has no place in the any-resolution grid (transformers fails on it);
    # a single tile keeps it as one more placeholder.
    strategies = ("default", "full") if not any_resolution else ("default",)
    require("vision_feature_select_strategy", strategy, strategy in strategies,
            f"a CLIP tower has a CLS token; supported: {', '.join(strategies)}")
    require("vision_feature_layer", layer,
            bool(layers) and all(isinstance(i, int) and -num_layers - 1 <= i <= num_layers for i in layers),
            f"each must index the {num_layers + 1} hidden states of the tower")
    if any_resolution:
        valid = all(len(p) == 2 and all(_positive_multiple(x, image_size) for x in p) for p in pinpoints)
        require("image_grid_pinpoints", full.get("image_grid_pinpoints"), bool(pinpoints) and valid,
                f"need (height, width) pairs, each a positive multiple of vision_config.image_size {image_size}")
    require("image_token_id", token, isinstance(token, int) and 0 <= token < text["vocab_size"],
            f"not a token of the {text['vocab_size']}-token vocabulary")

    base = normalised(llama_config_from_hf, text)
    if any_resolution:  # transformers 5 writes and obeys the top-level flag; transformers 4 obeyed the text config's
        tie = hf["tie_word_embeddings"] if "tie_word_embeddings" in hf else base.tie_word_embeddings
    else:  # transformers 5's LlavaConfig ties when either says so: its resolved flag
        tie = full["tie_word_embeddings"]
    return replace(
        base,
        model_type=model_type,
        tie_word_embeddings=bool(tie),
        vision=VisionConfig(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=num_layers,
            num_heads=vision["num_attention_heads"],
            image_size=image_size,
            patch_size=vision["patch_size"],
            layer_norm_eps=float(vision["layer_norm_eps"]),
            hidden_act=vision["hidden_act"],
            num_channels=vision["num_channels"],
            vision_feature_layer=layer if isinstance(layer, int) else layers,
            vision_feature_select_strategy=strategy,
            image_grid_pinpoints=pinpoints,  # type: ignore[arg-type]  # empty: single resolution
            image_token_id=token,
            projector_hidden_act=projector_act,
            multimodal_projector_bias=bool(full.get("multimodal_projector_bias", True)),
        ),
    )


def _positive_multiple(x: Any, of: int) -> bool:
    return isinstance(x, int) and x > 0 and x % of == 0
