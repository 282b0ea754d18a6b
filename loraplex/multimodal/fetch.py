"""fetch_image_bytes: one URL -> its bytes, by scheme. Blocking work runs in a thread."""

from __future__ import annotations

import asyncio

from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.data_url import decode_data_url
from loraplex.multimodal.errors import InvalidMediaURL, shorten
from loraplex.multimodal.http_fetch import fetch_http
from loraplex.multimodal.local_files import read_local_file


async def fetch_image_bytes(url: str, config: MediaConfig) -> bytes:
    """The raw (encoded) image bytes a URL names, at most max_image_bytes of them.

    data:image/...;base64 always; file:// or an absolute path inside allowed_local_media_path;
    http(s) from allowed_media_domains. Raises a MediaError subclass (with .status) otherwise.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        # base64 of up to 20 MiB: milliseconds, but not on the event loop.
        return await asyncio.to_thread(decode_data_url, url, config)
    if scheme == "file" or url.startswith("/"):
        return await asyncio.to_thread(read_local_file, url, config)
    if scheme in ("http", "https"):
        return await fetch_http(url, config)
    raise InvalidMediaURL(
        f"unsupported image URL {shorten(url)}: use data:image/...;base64, http(s)://, file:// or an absolute path"
    )
