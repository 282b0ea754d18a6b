"""load_images: the one call the server makes: URLs -> checked RGB images, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from PIL import Image

from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.decode import decode_image
from loraplex.multimodal.errors import MediaError, MediaTooLarge
from loraplex.multimodal.fetch import fetch_image_bytes


def check_image_count(count: int, config: MediaConfig) -> None:
    """Refuse a request with too many images before anything is fetched (413)."""
    if count > config.max_images_per_request:
        raise MediaTooLarge(
            f"request has {count} images; the limit is max_images_per_request = {config.max_images_per_request}",
            "max_images_per_request",
            config.max_images_per_request,
        )


async def load_images(urls: Sequence[str], config: MediaConfig) -> list[Image.Image]:
    """Fetch and decode every image, concurrently; the event loop only awaits (decoding runs in threads).

    The first failure cancels the other fetches and is raised, its message prefixed "image i of n".
    """
    check_image_count(len(urls), config)
    tasks = [asyncio.create_task(_load_one(url, i, len(urls), config)) for i, url in enumerate(urls)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # after a failure (or our own cancellation) stop the rest; no-op on success
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _load_one(url: str, i: int, n: int, config: MediaConfig) -> Image.Image:
    try:
        data = await fetch_image_bytes(url, config)
        return await asyncio.to_thread(decode_image, data, config)
    except MediaError as exc:
        raise exc.located(f"image {i + 1} of {n}") from None
