"""Small images made in memory for the tests, and a PNG that declares more pixels than it holds."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def encode(fmt: str, size=(5, 3), color=RED, mode="RGB", **save) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def two_frame_gif(size=(4, 4)) -> bytes:
    """Frame 1 red, frame 2 blue: the decoder must return red."""
    buffer = io.BytesIO()
    first, second = Image.new("RGB", size, RED), Image.new("RGB", size, BLUE)
    first.save(buffer, format="GIF", save_all=True, append_images=[second], duration=100, loop=0)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height RGB pixels, with a few bytes of pixel data: under
    200 bytes on the wire. Decoding it (load()) would fail as truncated, or allocate width*height*3."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _chunk(b"IEND", b"")
    )
