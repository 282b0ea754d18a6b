"""A request's images as its model's Hugging Face processor made them: pixel tensors plus the prompt positions
of the placeholder tokens they fill. Built at the edge (off the engine thread) and read by the engine."""

from __future__ import annotations

import bisect
import functools
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass
class ImageInputs:
    """One request's images as its model's Hugging Face processor returned them."""

    pixel_values: torch.Tensor  # [images, max_tiles, 3, H, W], zero-padded tiles (LLaVA 1.5: one tile each)
    image_sizes: list[tuple[int, int]]  # (height, width) of each original image
    token_id: int  # the placeholder token each image was expanded into (Mllama: one per image)
    positions: list[int] = field(default_factory=list)  # prompt positions of the placeholders, in order
    # Mllama: each image's aspect ratio id [images] and which of its tiles are real [images, max_tiles].
    aspect_ratio_ids: torch.Tensor | None = None
    aspect_ratio_mask: torch.Tensor | None = None
    # Mllama: where the request's image states are kept and which each row sees (an engine.image_states
    # ImageStateLayout, set by the engine; typed loosely because multimodal/ imports nothing from the engine).
    layout: Any = None

    @classmethod
    def for_prompt(cls, prompt_ids: list[int], pixel_values: torch.Tensor, image_sizes, token_id: int, **extra) -> "ImageInputs":
        """`pixel_values` [images, tiles, 3, H, W], or [images, 3, H, W] from a single-resolution processor
        (LLaVA 1.5's CLIPImageProcessor: one tile per image)."""
        if pixel_values.dim() == 4:
            pixel_values = pixel_values.unsqueeze(1)
        positions = [i for i, t in enumerate(prompt_ids) if t == token_id]
        return cls(pixel_values, [tuple(s) for s in image_sizes], token_id, positions, **extra)

    @classmethod
    def from_processor(cls, outputs, image_sizes: list[tuple[int, int]], token_id: int) -> "ImageInputs":
        """One prompt's Hugging Face processor outputs (`return_tensors="pt"`, a batch of one). LLaVA-NeXT:
        pixel_values [images, tiles, ...] and image_sizes; LLaVA 1.5: pixel_values [images, 3, H, W] only;
        Mllama: pixel_values [1, images, tiles, ...], aspect_ratio_ids and aspect_ratio_mask.
        `image_sizes`: (height, width) of each original image."""
        ids = outputs["input_ids"][0].tolist()
        if "aspect_ratio_ids" not in outputs:
            sizes = outputs["image_sizes"].tolist() if "image_sizes" in outputs else image_sizes
            return cls.for_prompt(ids, outputs["pixel_values"], sizes, token_id)
        return cls.for_prompt(
            ids, outputs["pixel_values"][0], image_sizes, token_id,
            aspect_ratio_ids=outputs["aspect_ratio_ids"][0], aspect_ratio_mask=outputs["aspect_ratio_mask"][0],
        )

    def for_ids(self, prompt_ids: list[int]) -> "ImageInputs":
        """The same images for another prompt (one cut from this one): placeholders found again."""
        return replace(self, positions=[i for i, t in enumerate(prompt_ids) if t == self.token_id], layout=None)

    @functools.cached_property
    def digest(self) -> bytes:
        """A digest of the pixels the model will see (prefix caching keys image-dependent blocks by it). Cached:
        the server computes it off the engine thread, beside the processor."""
        digest = hashlib.blake2b(digest_size=16)
        for t in (self.pixel_values, self.aspect_ratio_ids, self.aspect_ratio_mask):
            if t is not None:
                digest.update(str((t.dtype, tuple(t.shape))).encode())
                digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
        digest.update(repr(self.image_sizes).encode())
        return digest.digest()

    @property
    def num_images(self) -> int:
        return self.pixel_values.shape[0]

    @property
    def real_tiles(self) -> list[int]:
        """Mllama: how many of each image's tiles are real (the rest are padding)."""
        return [int(n) for n in self.aspect_ratio_mask.sum(dim=1).tolist()]

    def placeholders_in(self, start: int, end: int) -> tuple[int, int]:
        """The placeholders (as indices into `positions`, i.e. feature rows) that lie in [start, end)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)
