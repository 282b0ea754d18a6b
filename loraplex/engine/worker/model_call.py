"""The eager model call: one forward pass over a step's batch, with what the family's inputs declare
(models/base.py): an encoder's output, image states, or image features in the input embeddings. The graphed
decode step is the other model call (decode_graphs.py).

Also the prompt logprobs: the scores of the prompt tokens a step's hidden rows can give.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from loraplex.engine.worker.batch import StepBatch
from loraplex.engine.requests.images import ImageFeatures, VisionCounters, step_input_embeds
from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.lora.step.plan import LoraPlan
from loraplex.models.base import ModelFamily, ModelInputs
from loraplex.engine.sampling.sampler import token_scores
from loraplex.params import PromptScore


class ModelCall:
    def __init__(self, model: ModelFamily) -> None:
        self.model = model
        self.inputs = model.inputs
        # Per-request image features while prompts are prefilled (models that put images in the token stream).
        self.image_features = ImageFeatures() if ModelInputs.IMAGE_FEATURES in self.inputs else None
        # Encoder-decoder models: the last step's encoder output [encoder rows, hidden], in `batch.encoding` order.
        self.encoded: torch.Tensor | None = None
        self.vision_counters = (
            self.image_features.counters if self.image_features is not None
            else VisionCounters() if ModelInputs.IMAGE_STATES in self.inputs else None
        )

    def forget(self, request_id: str) -> None:
        """Drop what the call holds for a request that left the engine."""
        if self.image_features is not None:
            self.image_features.drop(request_id)

    def forward(self, scheduled: list[ScheduledRequest], batch: StepBatch, lora: LoraPlan | None) -> torch.Tensor:
        """Hidden states of the step's token rows (inside the step's forward context)."""
        if ModelInputs.ENCODER in self.inputs:
            encoded = None
            if batch.encoder_ids is not None:  # several requests' encoders in one call, rows concatenated
                encoded = self.model.encode(batch.encoder_ids, batch.encoder_positions)
            self.encoded = encoded  # this step's encoder output (embedding requests pool it)
            return self.model(batch.input_ids, batch.positions, encoder_hidden=encoded)
        if ModelInputs.IMAGE_STATES in self.inputs:
            made = self._image_states([scheduled[i].request for i in batch.encoding], lora) if batch.encoding else None
            return self.model(batch.input_ids, batch.positions, cross_states=made)
        if self.image_features is None:
            return self.model(batch.input_ids, batch.positions)
        embeds = step_input_embeds(
            self.model, scheduled, batch.input_ids, batch.metadata.query_start_loc, self.image_features, lora
        )
        hidden = self.model(batch.input_ids, batch.positions, inputs_embeds=embeds)
        for item in scheduled:  # a prompt fully computed needs its image features no more
            request = item.request
            if request.images is not None and request.num_computed_tokens + item.num_new_tokens >= len(request.prompt_ids):
                self.image_features.drop(request.request_id)
        return hidden

    def _image_states(self, requests: list, lora: LoraPlan | None) -> torch.Tensor:
        """The image states of `requests` [their num_states, hidden], each request's in its layout's order.

        All their images go through the image encoder as one batch, each request's contiguous (in slot
        order: one LoRA segment per adapter, counted in images)."""
        if lora is not None:
            lora.set_rows("patches", [r.adapter_slot for r in requests], [r.images.num_images for r in requests])
        weight = next(self.model.parameters())
        started = time.perf_counter()
        states = self.model.image_states(
            torch.cat([r.images.pixel_values for r in requests]).to(weight.device, weight.dtype),
            torch.cat([r.images.aspect_ratio_ids for r in requests]).to(weight.device),
            torch.cat([r.images.aspect_ratio_mask for r in requests]).to(weight.device),
        )  # [images, tiles, states_per_tile, hidden]
        self.vision_counters.record(states.shape[0], time.perf_counter() - started)
        per_request, first = [], 0
        for r in requests:
            mine = states[first : first + r.images.num_images].flatten(0, 1)  # [tiles, states_per_tile, hidden]
            first += r.images.num_images
            order = torch.tensor(r.images.layout.tile_order, device=mine.device)
            per_request.append(mine.index_select(0, order).flatten(0, 1))
        return torch.cat(per_request)


def wants_prompt_logprobs(request) -> bool:
    """Whether the request asked for prompt logprobs and some of its prompt is still unscored."""
    return bool(request.params.prompt_logprobs) and len(request.prompt_logprobs or []) < len(request.prompt_ids)


def prompt_logprobs(
    item: ScheduledRequest, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> list[PromptScore | None]:
    """The scores of the prompt tokens this step can score, given the tokens before each (their logprobs, ranks,
    and the request's `prompt_top_n` likeliest tokens); `hidden`: the request's rows of the step, `logits_of`: the
    head over some of them (with the request's adapter).

    Prompt token i is scored by the row of position i - 1, so a chunk [start, end) scores tokens
    start + 1 .. end; token 0 has none. Tokens already scored (before a preemption) are skipped.
    """
    request = item.request
    start = request.num_computed_tokens
    have = len(request.prompt_logprobs or [])
    values: list[PromptScore | None] = [None] if have == 0 else []
    first = max(have, start + 1)
    last = min(start + item.num_new_tokens, len(request.prompt_ids) - 1)  # inclusive
    if last >= first:
        logits = logits_of(hidden[first - 1 - start : last - start])
        # A token the head cannot produce (Mllama's image token, past its vocabulary) has no logprob.
        ids = request.prompt_ids[first : last + 1]
        producible = [0 <= t < logits.shape[1] for t in ids]
        targets = torch.tensor([t if ok else 0 for t, ok in zip(ids, producible)], device=logits.device)
        top_n = min(request.params.prompt_top_n, logits.shape[1])
        chosen, ranks, top_values, top_ids = (t.tolist() for t in token_scores(logits, targets, top_n))
        values += [PromptScore(lp, rank, tuple(zip(ids, lps))) if ok else None
                   for lp, rank, lps, ids, ok in zip(chosen, ranks, top_values, top_ids, producible)]
    return values
