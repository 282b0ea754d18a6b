"""load_images / open_images: the server's call: URLs -> checked RGB images, in order, decoded within
the per-request and server-wide budgets of decoded bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

from PIL import Image

from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.decode import ImageHeader, decode_pixels, read_header
from loraplex.multimodal.errors import MediaError, MediaTooLarge
from loraplex.multimodal.fetch import fetch_image_bytes

T = TypeVar("T")


def check_image_count(count: int, config: MediaConfig) -> None:
    """Refuse a request with too many images before anything is fetched (413)."""
    if count > config.max_images_per_request:
        raise MediaTooLarge(
            f"request has {count} images; the limit is max_images_per_request = {config.max_images_per_request}",
            "max_images_per_request",
            config.max_images_per_request,
        )


def check_decoded_bytes(headers: Sequence[ImageHeader], config: MediaConfig) -> int:
    """The decoded size of a request's images together, refused (413) past max_decoded_bytes_per_request
    or past max_decoded_bytes_total (the server-wide budget it could never fit)."""
    total = sum(header.decoded_bytes for header in headers)
    sizes = ", ".join("x".join(map(str, header.image.size)) for header in headers)
    what = f"the request's images ({sizes}) decode to {total} bytes (width x height x 3 each)"
    for limit in ("max_decoded_bytes_per_request", "max_decoded_bytes_total"):
        value = getattr(config, limit)
        if total > value:
            raise MediaTooLarge(f"{what}; the limit is {limit} = {value} bytes", limit, value)
    return total


@asynccontextmanager
async def open_images(urls: Sequence[str], config: MediaConfig) -> AsyncIterator[list[Image.Image]]:
    """The decoded images, their decoded size held against the server-wide budget until the block ends.

    Count, then fetch every image and read its header (concurrently; the first failure cancels the rest),
    then refuse the request past its budget, then wait for the server-wide budget, and only then decode
    (in threads, all of them to the end). A failure is raised prefixed "image i of n". The budget is
    released however the block ends, and not before the decoding threads have.
    """
    check_image_count(len(urls), config)
    if not urls:
        yield []
        return
    n = len(urls)
    headers = await _all(lambda i: _fetch_header(urls[i], config), n)
    size = check_decoded_bytes(headers, config)
    budget = config.decode_budget
    await budget.acquire(size)
    release = True
    try:
        decoding = asyncio.gather(*(asyncio.to_thread(decode_pixels, h) for h in headers), return_exceptions=True)
        try:
            results = await asyncio.shield(decoding)
        except asyncio.CancelledError:
            # A thread cannot be stopped mid-decode: its bytes stay reserved until every decode has ended.
            decoding.add_done_callback(lambda _: budget.release(size))
            release = False
            raise
        del headers  # the lazily opened images (and their bytes) go; the decoded ones stay
        for i, result in enumerate(results):  # every decode has ended: the first failed image is raised
            if isinstance(result, MediaError):
                raise result.located(f"image {i + 1} of {n}") from None
            if isinstance(result, BaseException):
                raise result
        yield results
    finally:
        if release:
            budget.release(size)


async def load_images(urls: Sequence[str], config: MediaConfig) -> list[Image.Image]:
    """Fetch and decode every image (see open_images). The budget is released on return: the server uses
    open_images to hold it while the images are processed."""
    async with open_images(urls, config) as images:
        return images


async def _fetch_header(url: str, config: MediaConfig) -> ImageHeader:
    data = await fetch_image_bytes(url, config)
    return await asyncio.to_thread(read_header, data, config)


async def _located(work: Awaitable[T], i: int, n: int) -> T:
    try:
        return await work
    except MediaError as exc:
        raise exc.located(f"image {i + 1} of {n}") from None


async def _all(work: Callable[[int], Awaitable[T]], n: int) -> list[T]:
    """work(i) for every image concurrently, in order; the first failure cancels the rest."""
    tasks = [asyncio.create_task(_located(work(i), i, n)) for i in range(n)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # after a failure (or our own cancellation) stop the rest; no-op on success
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
