"""data:image/...;base64 URLs: always allowed, size-checked before decoding the base64."""

import pytest

from loraplex.multimodal import InvalidMediaURL, MediaConfig, MediaTooLarge, UnsupportedMediaType, fetch_image_bytes, load_images
from loraplex.multimodal.data_url import max_base64_chars

from .aio import run
from .images import BLUE, RED, data_url, encode, two_frame_gif

CONFIG = MediaConfig()  # everything off but data URLs


@pytest.mark.parametrize("fmt, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_data_url_images_load(fmt, media_type):
    [image] = run(load_images([data_url(encode(fmt, size=(6, 4), color=BLUE, quality=95), media_type)], CONFIG))
    assert image.mode == "RGB" and image.size == (6, 4)
    r, g, b = image.getpixel((2, 2))
    assert b > 240 and r < 15 and g < 15


def test_data_url_gif_loads_its_first_frame():
    [image] = run(load_images([data_url(two_frame_gif(), "image/gif")], CONFIG))
    assert image.getpixel((1, 1)) == RED


def test_declared_subtype_does_not_decide_the_format():
    # Clients often label a JPEG as image/png: the bytes decide.
    [image] = run(load_images([data_url(encode("JPEG", size=(3, 3)), "image/png")], CONFIG))
    assert image.size == (3, 3)


def test_bytes_are_returned_exactly():
    data = encode("PNG")
    assert run(fetch_image_bytes(data_url(data), CONFIG)) == data


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64,iVBORw0KGgo*notbase64", "data URL is not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "data URL is not valid base64"),  # 11 characters: bad padding
        ("data:image/png,rawbytes", "data URLs must be base64-encoded"),
        ("data:image/png;base64", "data URL has no ','"),
    ],
)
def test_bad_data_urls_are_400(url, message):
    with pytest.raises(InvalidMediaURL) as caught:
        run(fetch_image_bytes(url, CONFIG))
    assert caught.value.status == 400 and message in str(caught.value)


def test_non_image_media_type_is_415():
    with pytest.raises(UnsupportedMediaType, match="media type 'text/plain' is not an image type") as caught:
        run(fetch_image_bytes("data:text/plain;base64,aGVsbG8=", CONFIG))
    assert caught.value.status == 415


def test_data_url_of_a_text_file_is_415():
    with pytest.raises(UnsupportedMediaType, match="not an image in a supported format") as caught:
        run(load_images(["data:image/png;base64,aGVsbG8gd29ybGQ="], CONFIG))  # "hello world"
    assert caught.value.status == 415


def test_oversized_base64_is_refused_before_decoding():
    config = MediaConfig(max_image_bytes=30)
    assert max_base64_chars(30) == 40
    # 44 characters of which only the length matters: "!" is not base64, so decoding would fail
    # with a 400 had it been attempted.
    with pytest.raises(MediaTooLarge) as caught:
        run(fetch_image_bytes("data:image/png;base64," + "!" * 44, config))
    assert caught.value.status == 413 and caught.value.limit == "max_image_bytes" and caught.value.limit_value == 30
    assert str(caught.value) == "data URL holds 44 base64 characters, more than 40; the limit is max_image_bytes = 30 bytes"


def test_decoded_size_is_checked_exactly():
    config = MediaConfig(max_image_bytes=31)
    ok = data_url(bytes(31))  # 44 characters: up to 33 bytes could fit, 31 do
    assert len(run(fetch_image_bytes(ok, config))) == 31
    with pytest.raises(MediaTooLarge, match="data URL decodes to 32 bytes; the limit is max_image_bytes = 31 bytes"):
        run(fetch_image_bytes(data_url(bytes(32)), config))
