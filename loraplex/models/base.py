"""The model interface: what the engine's runner and loader may ask of a family's top-level class.

Each family declares which inputs its forward pass takes (`inputs`, a `ModelInputs` flag) and subclasses
`ModelFamily`, which gives the defaults of what only some families have (checkpoint renames, tensors a
checkpoint may lack or hold unused, layers whose cache holds only cross-attention states). The runner
picks its path from `inputs`, never from which methods a model happens to have; the narrower protocols
below say what each input kind adds to the interface.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from loraplex.models.config import ModelConfig


class ModelInputs(enum.Flag):
    """What a family's forward pass takes besides its token rows."""

    TEXT = enum.auto()  # token ids and positions (every family)
    IMAGE_FEATURES = enum.auto()  # image features in placeholder rows of the input embeddings (LLaVA-NeXT)
    IMAGE_STATES = enum.auto()  # per-request image states its cross-attention reads (Mllama)
    ENCODER = enum.auto()  # an encoder's output its cross-attention reads (T5, BART)


class ModelFamily(Protocol):
    """Every family: decoder rows in, hidden rows out, a head on top."""

    inputs: ClassVar[ModelInputs]
    # Checkpoint tensors that may be absent (filled with zeros) or present and unused (regexes).
    optional_checkpoint_tensors: ClassVar[tuple[str, ...]] = ()
    unused_checkpoint_tensors: ClassVar[tuple[str, ...]] = ()
    # Module names whose weights stay float32 in half precision.
    keep_in_float32: ClassVar[tuple[str, ...]] = ()
    # Layers whose KV cache holds only cross-attention states (they get a block pool of their own).
    state_layers: tuple[int, ...] = ()
    # Which input rows a linear reads where they are not the step's token rows, as (glob over its module name,
    # kind), the first match winning: "patches" (a vision tower's image tiles), "states" (cross-attention keys
    # and values made from an encoder's output or from image states), "encoder" (an encoder's own rows). The
    # output head (`lm_head`) reads the rows handed to `compute_logits` in every family.
    linear_rows: ClassVar[tuple[tuple[str, str], ...]] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **inputs) -> torch.Tensor:
        """Hidden states [rows, hidden] of the step's token rows; `inputs` as `inputs` declares."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        ...

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The module name a checkpoint tensor fills (families whose checkpoints come in several layouts)."""
        return name

    @classmethod
    def config_for_checkpoint(cls, config: ModelConfig, names: set[str]) -> tuple[ModelConfig, str | None]:
        """`config` as transformers builds the model for a checkpoint holding the tensors `names`, where the
        config and the file disagree, and one line saying what changed (None: nothing did)."""
        return config, None


class EncoderDecoderModel(ModelFamily, Protocol):
    """`ModelInputs.ENCODER`: forward(..., encoder_hidden=encode(ids, positions))."""

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ...


class ImageFeatureModel(ModelFamily, Protocol):
    """`ModelInputs.IMAGE_FEATURES`: forward(..., inputs_embeds=embeddings with image features placed)."""

    def tiles_per_image(self, image_sizes: list) -> list[int]:
        ...

    def encode_images(self, pixel_values: torch.Tensor, image_sizes: list) -> list[torch.Tensor]:
        ...


class ImageStateModel(ModelFamily, Protocol):
    """`ModelInputs.IMAGE_STATES`: forward(..., cross_states=image_states(...) of the requests starting)."""

    states_per_tile: int

    def image_states(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        ...
