"""Bytes -> RGB image, with every check made on the header before pixels are decoded.

1. The format is read from the first bytes (not the URL, not the declared type): PNG, JPEG, WebP and
   GIF are decoded; anything else is refused by name (415).
2. Width x height comes from the header (`Image.open` parses it without decoding) and is checked
   against max_image_pixels before `load()`: a 100-byte PNG declaring 20000 x 20000 never allocates.
   Pillow's own bomb guard (DecompressionBombError past 2 x Image.MAX_IMAGE_PIXELS) is caught and
   reported the same way; we leave that process-wide setting alone.
3. Only the first frame of an animated GIF or WebP is decoded. EXIF orientation is applied (as
   transformers' load_image does); transparency is composited onto white (as vLLM and transformers'
   convert_to_rgb do) rather than dropped to whatever colour hides under it.
read_header does 1-2 (cheap: the server counts every image's decoded size against its budgets before
any is decoded), decode_pixels does 3. CPU-bound: callers on an event loop run these in a thread.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image, ImageOps

from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.errors import (
    MediaDecodeError,
    MediaError,
    MediaTooLarge,
    UnsupportedMediaType,
    over_byte_limit,
)

SUPPORTED = "PNG, JPEG, WebP or GIF"


def sniff_format(data: bytes) -> str:
    """Pillow's format name for a supported image ("PNG", "JPEG", "WEBP", "GIF"), else 415 naming it."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    other = _other_format(data)
    if other:
        raise UnsupportedMediaType(f"{other} images are not supported; send {SUPPORTED}")
    raise UnsupportedMediaType(f"the data is not an image in a supported format ({SUPPORTED})")


def _other_format(data: bytes) -> str | None:
    """Names for formats people send by mistake, so the refusal says what was sent."""
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        return {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF"}.get(brand, "MP4/ISO media")
    signatures = {
        b"BM": "BMP",
        b"II*\x00": "TIFF",
        b"MM\x00*": "TIFF",
        b"\x00\x00\x01\x00": "ICO",
        b"8BPS": "PSD",
        b"%PDF": "PDF",
        b"qoif": "QOI",
        b"\xff\x0a": "JPEG XL",
        b"\x00\x00\x00\x0cJXL ": "JPEG XL",
        b"\x00\x00\x00\x0cjP  ": "JPEG 2000",
        b"\xff\x4f\xff\x51": "JPEG 2000",
    }
    for signature, name in signatures.items():
        if data.startswith(signature):
            return name
    head = data[:256].lstrip().lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in data[:4096].lower()):
        return "SVG"
    return None


@dataclass
class ImageHeader:
    """An image opened lazily: format and size read from its header, no pixel decoded yet."""

    image: Image.Image
    fmt: str
    config: MediaConfig

    @property
    def decoded_bytes(self) -> int:
        """What decoding it will hold: its RGB pixels, width x height x 3 bytes."""
        width, height = self.image.size
        return width * height * 3


def read_header(data: bytes, config: MediaConfig) -> ImageHeader:
    """Bytes, format and pixel count checked; the pixels are not decoded. Same errors as decode_image."""
    if len(data) > config.max_image_bytes:
        raise over_byte_limit(f"image is {len(data)} bytes", config.max_image_bytes)
    fmt = sniff_format(data)
    with _decoding(fmt, config):
        image = Image.open(io.BytesIO(data), formats=[fmt])  # parses the header; pixels not decoded yet
        check_pixels(*image.size, config)
        return ImageHeader(image, fmt, config)


def decode_pixels(header: ImageHeader) -> Image.Image:
    """The image's pixels decoded, first frame, EXIF orientation applied, RGB. CPU-bound: run in a thread."""
    with _decoding(header.fmt, header.config):
        image = header.image
        image.seek(0)  # first frame of an animation
        image.load()
        return _to_rgb(ImageOps.exif_transpose(image))


def decode_image(data: bytes, config: MediaConfig) -> Image.Image:
    """Checked, decoded, RGB. Raises UnsupportedMediaType (415), MediaTooLarge (413) or MediaDecodeError (422)."""
    return decode_pixels(read_header(data, config))


@contextmanager
def _decoding(fmt: str, config: MediaConfig) -> Iterator[None]:
    """Pillow's errors as ours."""
    try:
        yield
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own guard, in open() or a GIF frame's load()
        raise _too_many_pixels(f"image is too large to decode ({exc})", config) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated or corrupt data
        raise MediaDecodeError(f"cannot decode the {fmt} image ({exc})") from None


def check_pixels(width: int, height: int, config: MediaConfig) -> None:
    if width * height > config.max_image_pixels:
        raise _too_many_pixels(f"image is {width}x{height} = {width * height} pixels", config)


def _too_many_pixels(what: str, config: MediaConfig) -> MediaTooLarge:
    return MediaTooLarge(
        f"{what}; the limit is max_image_pixels = {config.max_image_pixels}", "max_image_pixels", config.max_image_pixels
    )


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
