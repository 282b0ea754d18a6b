"""Why an image was refused. Each exception carries the HTTP status that fits it (`.status`).

The server maps these onto each API's error shape (OpenAI routes may answer 400 for all of them);
the status here says what kind of refusal it is. Messages name the limit and its value so a client
can fix its request without reading the server's configuration.
"""

from __future__ import annotations


class MediaError(ValueError):
    """An image in the request cannot be used. A ValueError so generic validation handlers catch it."""

    status = 400

    def located(self, where: str) -> MediaError:
        """Prefix the message with which image it was ("image 2 of 3"), keeping the type."""
        self.args = (f"{where}: {self.args[0]}", *self.args[1:])
        return self


class InvalidMediaURL(MediaError):
    """The URL or content part is malformed: unknown scheme, bad base64, relative path, bad part."""

    status = 400


class MediaNotAllowed(MediaError):
    """The URL is well formed but policy refuses it: host not listed, private address, local files off,
    a path outside allowed_local_media_path. 400 like any bad field, not 403 (which clients read as
    an authentication problem)."""

    status = 400


class MediaTooLarge(MediaError):
    """A limit was exceeded: bytes, pixels or images per request. `.limit` names the MediaConfig field."""

    status = 413

    def __init__(self, message: str, limit: str, limit_value: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.limit_value = limit_value


class UnsupportedMediaType(MediaError):
    """The bytes are not an image in a format we decode (PNG, JPEG, WebP, GIF)."""

    status = 415


class MediaDecodeError(MediaError):
    """The header looked right but the image could not be decoded (truncated or corrupt)."""

    status = 422


class MediaFetchError(MediaError):
    """An allowed URL could not be fetched: connection failed, upstream status, missing file,
    too many redirects."""

    status = 422


class MediaFetchTimeout(MediaFetchError):
    """The fetch did not finish within fetch_timeout_s."""


def shorten(url: str, keep: int = 80) -> str:
    """A URL fit for an error message: a 20 MB data URL is not echoed back."""
    if url.startswith("data:"):
        head = url.split(",", 1)[0]
        return f"{head[:keep]},... ({len(url)} characters)"
    return url if len(url) <= keep else f"{url[:keep]}... ({len(url)} characters)"


def over_byte_limit(what: str, max_image_bytes: int) -> MediaTooLarge:
    """The one wording for a too-large image, wherever its bytes came from."""
    return MediaTooLarge(
        f"{what}; the limit is max_image_bytes = {max_image_bytes} bytes", "max_image_bytes", max_image_bytes
    )
