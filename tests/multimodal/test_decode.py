"""Bytes -> RGB image: format from the header, pixel count before decoding, first frame only."""

import io

import pytest
from PIL import Image

from loraplex.multimodal import MediaConfig, MediaDecodeError, MediaTooLarge, UnsupportedMediaType, decode_image

from .images import BLUE, GREEN, RED, bomb_png, encode, two_frame_gif

CONFIG = MediaConfig()


@pytest.mark.parametrize(
    "fmt, save",
    [("PNG", {}), ("JPEG", {"quality": 95}), ("WEBP", {"lossless": True}), ("GIF", {})],
)
def test_supported_formats_decode_to_rgb(fmt, save):
    image = decode_image(encode(fmt, size=(7, 5), color=GREEN, **save), CONFIG)
    assert image.mode == "RGB" and image.size == (7, 5)
    r, g, b = image.getpixel((3, 2))
    assert g > 240 and r < 15 and b < 15  # JPEG is lossy; near enough


def test_gif_first_frame_only():
    image = decode_image(two_frame_gif(), CONFIG)
    assert image.size == (4, 4) and image.getpixel((0, 0)) == RED


def test_transparency_is_composited_on_white():
    data = encode("PNG", size=(2, 2), color=(0, 0, 255, 0), mode="RGBA")  # fully transparent blue
    assert decode_image(data, CONFIG).getpixel((1, 1)) == (255, 255, 255)
    half = encode("PNG", size=(2, 2), color=(0, 0, 0, 128), mode="RGBA")
    assert decode_image(half, CONFIG).getpixel((0, 0)) == (127, 127, 127)


def test_grey_and_palette_become_rgb():
    assert decode_image(encode("PNG", color=200, mode="L"), CONFIG).getpixel((0, 0)) == (200, 200, 200)
    palette = Image.new("RGB", (3, 3), BLUE).convert("P")
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG")
    assert decode_image(buffer.getvalue(), CONFIG).getpixel((2, 2)) == BLUE


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (6, 2), RED)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    assert decode_image(buffer.getvalue(), CONFIG).size == (2, 6)


def test_bomb_png_declaring_20000_squared_is_refused_from_its_header():
    data = bomb_png(20000, 20000)
    assert len(data) < 200
    with pytest.raises(MediaTooLarge) as caught:
        decode_image(data, CONFIG)
    assert caught.value.status == 413
    assert caught.value.limit == "max_image_pixels" and caught.value.limit_value == 4096 * 4096
    assert "400000000 pixels" in str(caught.value)
    assert "the limit is max_image_pixels = 16777216" in str(caught.value)


def test_pixel_limit_is_checked_before_decoding():
    # 5000x5000 is under Pillow's own guard, so this is our check. The pixel data is truncated: had
    # load() run, the error would be a 422 decode error, not this 413.
    with pytest.raises(MediaTooLarge) as caught:
        decode_image(bomb_png(5000, 5000), CONFIG)
    assert str(caught.value) == "image is 5000x5000 = 25000000 pixels; the limit is max_image_pixels = 16777216"
    with pytest.raises(MediaDecodeError) as truncated:  # the same bytes, allowed: decoding fails
        decode_image(bomb_png(50, 50), CONFIG)
    assert truncated.value.status == 422 and "PNG" in str(truncated.value)


def test_pixel_limit_from_config():
    small = MediaConfig(max_image_pixels=20)
    assert decode_image(encode("PNG", size=(5, 4)), small).size == (5, 4)
    with pytest.raises(MediaTooLarge, match=r"image is 5x5 = 25 pixels; the limit is max_image_pixels = 20"):
        decode_image(encode("PNG", size=(5, 5)), small)


def test_byte_limit():
    data = encode("PNG", size=(5, 5))
    with pytest.raises(MediaTooLarge, match=f"image is {len(data)} bytes; the limit is max_image_bytes = 10 bytes"):
        decode_image(data, MediaConfig(max_image_bytes=10))


@pytest.mark.parametrize(
    "data, name",
    [
        (encode("BMP"), "BMP images are not supported; send PNG, JPEG, WebP or GIF"),
        (encode("TIFF"), "TIFF images are not supported"),
        (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "SVG images are not supported"),
        (b"%PDF-1.7\n", "PDF images are not supported"),
        (b"hello, I am a text file\n", "the data is not an image in a supported format (PNG, JPEG, WebP or GIF)"),
        (b"", "the data is not an image"),
    ],
)
def test_unsupported_formats_are_refused_by_name(data, name):
    with pytest.raises(UnsupportedMediaType) as caught:
        decode_image(data, CONFIG)
    assert caught.value.status == 415
    assert name in str(caught.value)


def test_corrupt_image_is_a_decode_error():
    data = encode("PNG", size=(64, 64))
    with pytest.raises(MediaDecodeError) as caught:
        decode_image(data[:60], CONFIG)
    assert caught.value.status == 422
    assert "PNG" in str(caught.value)
