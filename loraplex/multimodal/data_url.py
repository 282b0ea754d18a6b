"""`data:image/...;base64,...` URLs: always allowed, size-checked before and after decoding."""

from __future__ import annotations

import base64
import binascii

from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.errors import InvalidMediaURL, UnsupportedMediaType, over_byte_limit, shorten


def max_base64_chars(max_bytes: int) -> int:
    """Longest padded base64 text that can decode to at most max_bytes."""
    return 4 * -(-max_bytes // 3)


def decode_data_url(url: str, config: MediaConfig) -> bytes:
    """The decoded bytes. The declared media type must be image/*; the format itself is read from the
    bytes later (clients often label a JPEG image/png), so the subtype is not checked here."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise InvalidMediaURL(f"data URL has no ',' before its data: {shorten(url)}")
    media_type, *params = head[len("data:"):].split(";")
    if "base64" not in (p.strip().lower() for p in params):
        raise InvalidMediaURL(f"data URLs must be base64-encoded (data:image/...;base64,...): {shorten(url)}")
    if not media_type.strip().lower().startswith("image/"):
        raise UnsupportedMediaType(f"data URL media type {media_type or '(none)'!r} is not an image type (image/...)")
    # Refuse by length before decoding: text that long cannot decode to an allowed size.
    limit = max_base64_chars(config.max_image_bytes)
    if len(payload) > limit:
        raise over_byte_limit(f"data URL holds {len(payload)} base64 characters, more than {limit}", config.max_image_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidMediaURL(f"data URL is not valid base64 ({exc})") from None
    if len(data) > config.max_image_bytes:  # that many characters can hold up to 2 bytes more
        raise over_byte_limit(f"data URL decodes to {len(data)} bytes", config.max_image_bytes)
    return data

