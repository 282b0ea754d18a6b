"""Prompts with images: fetch and check the images (loraplex.multimodal; decoded within the per-request and
server-wide budgets of decoded bytes, MediaConfig), then let the model's own
Hugging Face processor resize, tile and normalise them and expand each image's placeholder into its
tokens, off the event loop and off the engine thread. Shared by the native and the OpenAI routes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from loraplex.multimodal.image_inputs import ImageInputs
from loraplex.engine.requests.inputs import ImagesWithoutPlaceholders
from loraplex.engine.requests.request import RequestRefused
from loraplex.multimodal import open_images
from loraplex.server.errors import BadRequest
from loraplex.server.state import ServerState

T = TypeVar("T")


def image_placeholder(state: ServerState) -> str:
    """The text that stands for one image in a prompt (LLaVA: "<image>")."""
    return state.model.processor.image_token if state.model.takes_images else "<image>"


def check_takes_images(state: ServerState, param: str) -> None:
    """A request with images for a model that takes none is refused, naming the field they came in."""
    try:
        state.model.limits.check_takes_images()
    except RequestRefused as refused:
        raise BadRequest(str(refused), param) from None


async def encode_prompt(
    state: ServerState, prompt: str, urls: list[str], add_special_tokens: bool, param: str
) -> tuple[list[int], ImageInputs | None]:
    """Token ids of `prompt` (its image placeholders expanded) and the images' inputs; `param` names the
    request field the images came from, for errors."""
    state.validation.check_length(prompt, param)
    if not urls:
        # Off the event loop: a long prompt takes the tokenizer seconds, during which nothing else would answer.
        return await state.validation.run(state.tokenizer.encode, prompt, add_special_tokens=add_special_tokens), None
    check_takes_images(state, param)
    processor = state.model.processor
    # The images' decoded size is held against the server-wide budget until the processor is done with them.
    async with open_images(urls, state.config.media) as images:
        started = time.perf_counter()
        try:
            out = await _to_the_end(state.validation.run(
                processor, text=prompt, images=images, return_tensors="pt", add_special_tokens=add_special_tokens
            ))
        except ValueError as exc:  # the processor's own checks (image tokens vs images, sizes)
            raise BadRequest(f"the images cannot be processed with this prompt: {exc}", param) from exc
        state.metrics.on_images(len(images), time.perf_counter() - started)
        sizes = [(image.height, image.width) for image in images]
        del images
    ids = out["input_ids"][0].tolist()
    token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    inputs = ImageInputs.from_processor(out, sizes, token_id)
    try:
        state.model.limits.check_images(ids, inputs)
    except ImagesWithoutPlaceholders:
        raise BadRequest("the prompt has no place for its images (the chat template dropped them)", param) from None
    await state.validation.run(lambda: inputs.digest)  # hashed here, not on the engine thread (prefix caching)
    return ids, inputs


async def _to_the_end(work: Awaitable[T]) -> T:
    """Await work running in a thread; cancelled, still wait for the thread (it cannot be stopped) before
    the cancellation goes on, so the images' budget is not released while the processor still holds them."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved: the request is gone, its outcome is not news
        raise
