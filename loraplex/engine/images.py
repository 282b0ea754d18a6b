"""A request's images inside the engine: what the model's processor made of them, and the image
features computed from them (an engine-owned per-request state, DESIGN.md section 7).

The scheduler sees only token counts: each image is already expanded into its placeholder tokens in the
prompt. The runner encodes a request's images at the first prefill step that reaches a placeholder,
scatters the features into those rows' embeddings (slicing them across prefill chunks), and drops them
once the prompt is computed; a preempted request re-encodes when its prompt is prefilled again.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.engine.image_states import ImageStateLayout


@dataclass
class ImageInputs:
    """One request's images as its model's Hugging Face processor returned them."""

    pixel_values: torch.Tensor  # [images, max_tiles, 3, H, W], zero-padded tiles
    image_sizes: list[tuple[int, int]]  # (height, width) of each original image
    token_id: int  # the placeholder token each image was expanded into (Mllama: one per image)
    positions: list[int] = field(default_factory=list)  # prompt positions of the placeholders, in order
    # Mllama: each image's aspect ratio id [images] and which of its tiles are real [images, max_tiles].
    aspect_ratio_ids: torch.Tensor | None = None
    aspect_ratio_mask: torch.Tensor | None = None
    # Mllama: where the request's image states are kept and which each row sees (set by the engine).
    layout: "ImageStateLayout | None" = None

    @classmethod
    def for_prompt(cls, prompt_ids: list[int], pixel_values: torch.Tensor, image_sizes, token_id: int, **extra) -> "ImageInputs":
        positions = [i for i, t in enumerate(prompt_ids) if t == token_id]
        return cls(pixel_values, [tuple(s) for s in image_sizes], token_id, positions, **extra)

    @classmethod
    def from_processor(cls, outputs, image_sizes: list[tuple[int, int]], token_id: int) -> "ImageInputs":
        """One prompt's Hugging Face processor outputs (`return_tensors="pt"`, a batch of one). LLaVA-NeXT:
        pixel_values [images, tiles, ...] and image_sizes; Mllama: pixel_values [1, images, tiles, ...],
        aspect_ratio_ids and aspect_ratio_mask. `image_sizes`: (height, width) of each original image."""
        ids = outputs["input_ids"][0].tolist()
        if "aspect_ratio_ids" not in outputs:
            return cls.for_prompt(ids, outputs["pixel_values"], outputs["image_sizes"].tolist(), token_id)
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


@dataclass
class VisionCounters:
    """Totals of the image encoder's work, for metrics."""

    encoded_images: int = 0
    encode_seconds: float = 0.0  # host time (on CUDA: launch time only)

    def record(self, images: int, seconds: float) -> None:
        self.encoded_images += images
        self.encode_seconds += seconds


class ImageFeatures:
    """Image features per request id, [placeholders, hidden] each, while its prompt is being prefilled."""

    def __init__(self) -> None:
        self._by_request: dict[str, torch.Tensor] = {}
        self.counters = VisionCounters()

    def get(self, request_id: str) -> torch.Tensor | None:
        return self._by_request.get(request_id)

    def put(self, request_id: str, features: torch.Tensor) -> None:
        self._by_request[request_id] = features

    def drop(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_request)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self._by_request.values())


def step_input_embeds(
    model, scheduled, input_ids: torch.Tensor, query_start_loc: list[int], features: ImageFeatures, lora
) -> torch.Tensor | None:
    """The step's input embeddings with image features in their placeholder rows, or None when no
    scheduled chunk reaches a placeholder (then the model embeds the tokens itself).

    Requests that need features they do not have are encoded together, in `scheduled` order (sorted by
    adapter slot), with each request's image tiles mapped to its own adapter (the LoRA plan's `patches`).
    """
    chunks = []  # (row of the chunk's first token, request, first and last feature row it needs)
    for s, item in enumerate(scheduled):
        images = item.request.images
        if images is None:
            continue
        start = item.request.num_computed_tokens
        first, last = images.placeholders_in(start, start + item.num_new_tokens)
        if first < last:
            chunks.append((query_start_loc[s] - start, item.request, first, last))
    if not chunks:
        return None
    _encode_missing([request for _, request, _, _ in chunks], model, features, lora)
    embeds = model.embed_tokens(input_ids)
    for row_offset, request, first, last in chunks:
        rows = torch.tensor(request.images.positions[first:last], device=embeds.device) + row_offset
        embeds.index_copy_(0, rows, features.get(request.request_id)[first:last].to(embeds.dtype))
    return embeds


def _encode_missing(requests, model, features: ImageFeatures, lora) -> None:
    todo = [r for r in requests if features.get(r.request_id) is None]
    if not todo:
        return
    sizes = [size for r in todo for size in r.images.image_sizes]
    tiles = model.tiles_per_image(sizes)
    pixel_values = _pad_tiles([r.images.pixel_values for r in todo])
    if lora is not None:  # each request's tiles are contiguous, in slot order: one segment per adapter
        per_request, i = [], 0
        for r in todo:
            per_request.append(sum(tiles[i : i + r.images.num_images]))
            i += r.images.num_images
        lora.set_rows("patches", [r.adapter_slot for r in todo], per_request)
    weight = next(model.parameters())
    started = time.perf_counter()
    encoded = model.encode_images(pixel_values.to(weight.device, weight.dtype), sizes)
    features.counters.record(len(sizes), time.perf_counter() - started)
    i = 0
    for r in todo:
        mine = torch.cat(encoded[i : i + r.images.num_images])
        i += r.images.num_images
        assert mine.shape[0] == len(r.images.positions), (
            f"{mine.shape[0]} image features for {len(r.images.positions)} placeholder tokens"
        )
        features.put(r.request_id, mine)


def _pad_tiles(pixel_values: list[torch.Tensor]) -> torch.Tensor:
    """Requests' [images, tiles, 3, H, W] batches as one, tiles zero-padded to the most any has."""
    most = max(p.shape[1] for p in pixel_values)
    padded = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in pixel_values]
    return torch.cat(padded)
