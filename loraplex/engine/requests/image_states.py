"""Where a request's image states live in its state blocks, and which of them each token row sees
(Mllama: cross-attention layers read image states; images never enter the token stream).

Which images a row sees is transformers' cross-attention mask (`get_cross_attention_token_mask` and the
dense mask built from it): image i is seen by the prompt rows from its `<|image|>` token up to the next
image's token; images whose tokens are adjacent are all seen from there to the end of the group's span;
the last image (group) is seen to the end of the prompt, and every generated row sees what the last
prompt row does. Only an image's real tiles are seen, so only those are stored.

A row that sees no image (before the request's first image token) gets no cross-attention output and no
cross-layer feed-forward output, as in Meta's reference code and vLLM. transformers differs there: it
lets such a row attend to every state of the batch (huggingface/transformers#39379), which makes a
row's output depend on the images of other requests in its batch.

The states are stored so that what any row sees is one contiguous range: each image's real tiles, image
after image.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loraplex.engine.requests.request import RequestRefused


@dataclass(frozen=True)
class ImageStateLayout:
    states_per_tile: int
    # The real tile (image * max_tiles + tile, in the processor's order) stored at each tile place.
    tile_order: tuple[int, ...]
    # Per prompt row: the states it sees, [first, end) (empty: none), and whether it sees an image at all.
    row_first: tuple[int, ...]
    row_end: tuple[int, ...]
    row_seeing: tuple[bool, ...]

    @property
    def num_states(self) -> int:
        return len(self.tile_order) * self.states_per_tile

    @classmethod
    def build(
        cls, image_positions: list[int], prompt_len: int, real_tiles: list[int], max_tiles: int, states_per_tile: int
    ) -> "ImageStateLayout":
        assert len(image_positions) == len(real_tiles) > 0, "one <|image|> token per image"
        assert all(0 < n <= max_tiles for n in real_tiles), f"real tiles {real_tiles} out of 1..{max_tiles}"
        tiles = tuple(i * max_tiles + t for i, n in enumerate(real_tiles) for t in range(n))
        starts, first_tile = [], 0  # each image's first state
        for n in real_tiles:
            starts.append(first_tile * states_per_tile)
            first_tile += n
        ends = [start + n * states_per_tile for start, n in zip(starts, real_tiles)]
        rows = image_rows(image_positions, prompt_len)
        first, end, seeing = [], [], []
        for row in range(prompt_len):
            seen = [i for i, (a, b) in enumerate(rows) if a <= row < b]
            assert seen == list(range(seen[0], seen[-1] + 1)) if seen else True, "a row sees a run of adjacent images"
            first.append(starts[seen[0]] if seen else 0)
            end.append(ends[seen[-1]] if seen else 0)
            seeing.append(bool(seen))
        return cls(states_per_tile, tiles, tuple(first), tuple(end), tuple(seeing))

    def rows(self, start: int, end: int) -> tuple[list[int], list[int], list[bool]]:
        """first, end and seeing for positions start..end - 1 (past the prompt: as its last row)."""
        last = len(self.row_first) - 1
        positions = [min(p, last) for p in range(start, end)]
        return (
            [self.row_first[p] for p in positions],
            [self.row_end[p] for p in positions],
            [self.row_seeing[p] for p in positions],
        )


def image_rows(image_positions: list[int], prompt_len: int) -> list[tuple[int, int]]:
    """[start, end) of the prompt rows that see each image: to the next image's token, adjacent images'
    spans joined to the end of the last one's, the last image to the end of the prompt."""
    spans = [[p, q] for p, q in zip(image_positions, [*image_positions[1:], prompt_len])]
    later_end = spans[-1][1]
    for span in reversed(spans):
        if span[1] == span[0] + 1:  # the next image's token follows at once
            span[1] = later_end
        later_end = span[1]
    return [(a, b) for a, b in spans]


def with_state_layout(images, prompt_len: int, max_num_tiles: int, states_per_tile: int):
    """A request's Mllama images (a multimodal.image_inputs.ImageInputs) with the layout of their states: one
    image token per image and the processor's tiling are checked first (RequestRefused saying what is wrong)."""
    if len(images.positions) != images.num_images:
        raise RequestRefused(
            f"the prompt has {len(images.positions)} image tokens for {images.num_images} images (one each)"
        )
    if images.aspect_ratio_ids is None or images.aspect_ratio_mask is None:
        raise RequestRefused("the images lack the processor's aspect_ratio_ids / aspect_ratio_mask")
    tiles = images.pixel_values.shape[1]
    if tiles != max_num_tiles or min(images.real_tiles) < 1:
        raise RequestRefused(f"each image needs {max_num_tiles} tiles (real ones first); got {tiles}")
    layout = ImageStateLayout.build(images.positions, prompt_len, images.real_tiles, tiles, states_per_tile)
    return replace(images, layout=layout)
