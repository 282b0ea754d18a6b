"""Embedding requests' vectors: the final hidden rows of a prompt pooled as its `Pooling` says (params.py).

A prompt may be prefilled over several steps (chunks): the mean keeps a running sum and count, the first row is kept
from the step that starts the prompt, the largest values are kept as they come, the last row comes with the step that completes it. A request that starts
again (preempted and recomputed) starts its sums again. Sums are float32, whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.scheduling.scheduler import ScheduledRequest


@dataclass
class _Partial:
    total: torch.Tensor | None = None
    count: int = 0
    first: torch.Tensor | None = None
    largest: torch.Tensor | None = None


class Pooler:
    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def add(self, item: ScheduledRequest, rows: torch.Tensor) -> list[float] | None:
        """Take this step's hidden rows [n, hidden] of an embedding request; its vector once its prompt is complete."""
        request = item.request
        pooling = request.params.pooling
        assert pooling is not None, "pooling a request that asked for no embedding"
        if request.num_computed_tokens == 0:  # the prompt starts (again): nothing before counts
            self._partial.pop(request.request_id, None)
        partial = self._partial.setdefault(request.request_id, _Partial())
        if pooling.method == "mean":
            chunk = rows.float().sum(dim=0)
            partial.total = chunk if partial.total is None else partial.total + chunk
            partial.count += rows.shape[0]
        elif pooling.method == "first" and request.num_computed_tokens == 0:
            partial.first = rows[0].float()
        elif pooling.method == "max":
            chunk = rows.float().amax(dim=0)
            partial.largest = chunk if partial.largest is None else torch.maximum(partial.largest, chunk)
        if not item.completes_sequence:
            return None
        del self._partial[request.request_id]
        if pooling.method == "mean":
            vector = partial.total / partial.count
        elif pooling.method == "first":
            assert partial.first is not None, "the first row was not pooled: the prompt did not start from token 0"
            vector = partial.first
        elif pooling.method == "max":
            vector = partial.largest
        else:
            vector = rows[-1].float()
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def forget(self, request_id: str) -> None:
        self._partial.pop(request_id, None)
