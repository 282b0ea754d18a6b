"""The image features computed from a request's images (multimodal/image_inputs.py), an engine-owned
per-request state (docs/architecture.md, "Images (vision models)").

The scheduler sees only token counts: each image is already expanded into its placeholder tokens in the
prompt. The runner encodes a request's images at the first prefill step that reaches a placeholder,
scatters the features into those rows' embeddings (slicing them across prefill chunks), and drops them
once the prompt is computed; a preempted request re-encodes when its prompt is prefilled again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch



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
