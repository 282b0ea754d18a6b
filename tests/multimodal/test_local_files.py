"""Local files: off by default, only inside allowed_local_media_path, symlinks resolved first."""

import os

import pytest

from loraplex.multimodal import (
    InvalidMediaURL,
    MediaConfig,
    MediaFetchError,
    MediaNotAllowed,
    MediaTooLarge,
    UnsupportedMediaType,
    load_images,
)

from .aio import run
from .images import GREEN, encode


@pytest.fixture
def media(tmp_path):
    """allowed/ holds green.png; outside/ (next to it) holds secret.png."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "green.png").write_bytes(encode("PNG", size=(4, 3), color=GREEN))
    (outside / "secret.png").write_bytes(encode("PNG"))
    return allowed, outside


def test_local_files_are_off_by_default(media):
    allowed, _ = media
    for url in (str(allowed / "green.png"), (allowed / "green.png").as_uri()):
        with pytest.raises(MediaNotAllowed) as caught:
            run(load_images([url], MediaConfig()))
        assert caught.value.status == 400
        assert "local image files are not allowed (the server has no allowed_local_media_path)" in str(caught.value)


def test_allowed_file_loads_by_path_and_file_url(media):
    allowed, _ = media
    config = MediaConfig(allowed_local_media_path=str(allowed))
    images = run(load_images([str(allowed / "green.png"), (allowed / "green.png").as_uri(), f"file://localhost{allowed}/green.png"], config))
    assert [i.size for i in images] == [(4, 3)] * 3
    assert images[1].getpixel((3, 2)) == GREEN


def test_path_outside_is_refused(media):
    allowed, outside = media
    config = MediaConfig(allowed_local_media_path=str(allowed))
    for url in (str(outside / "secret.png"), f"{allowed}/../outside/secret.png", "/etc/passwd", str(outside / "missing.png")):
        with pytest.raises(MediaNotAllowed, match="is outside allowed_local_media_path") as caught:
            run(load_images([url], config))
        assert caught.value.status == 400


def test_symlink_escape_is_refused(media):
    allowed, outside = media
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "linkdir").symlink_to(outside)
    config = MediaConfig(allowed_local_media_path=str(allowed))
    for url in (str(allowed / "link.png"), str(allowed / "linkdir" / "secret.png")):
        with pytest.raises(MediaNotAllowed, match="is outside allowed_local_media_path"):
            run(load_images([url], config))


def test_symlink_inside_is_followed(media):
    allowed, _ = media
    (allowed / "alias.png").symlink_to(allowed / "green.png")
    [image] = run(load_images([str(allowed / "alias.png")], MediaConfig(allowed_local_media_path=str(allowed))))
    assert image.getpixel((0, 0)) == GREEN


def test_allowed_dir_reached_through_a_symlink(media, tmp_path):
    allowed, _ = media
    (tmp_path / "via").symlink_to(allowed)
    config = MediaConfig(allowed_local_media_path=str(tmp_path / "via"))
    [image] = run(load_images([str(tmp_path / "via" / "green.png")], config))
    assert image.size == (4, 3)


def test_size_is_checked_before_reading(media):
    allowed, _ = media
    big = allowed / "big.png"
    with open(big, "wb") as f:
        f.truncate(5000)  # sparse: size without data
    with pytest.raises(MediaTooLarge) as caught:
        run(load_images([str(big)], MediaConfig(allowed_local_media_path=str(allowed), max_image_bytes=4096)))
    assert caught.value.status == 413
    assert "local image is 5000 bytes; the limit is max_image_bytes = 4096 bytes" in str(caught.value)


def test_missing_file_fifo_and_text_file(media):
    allowed, _ = media
    config = MediaConfig(allowed_local_media_path=str(allowed))
    with pytest.raises(MediaFetchError, match="does not exist") as caught:
        run(load_images([str(allowed / "nope.png")], config))
    assert caught.value.status == 422
    os.mkfifo(allowed / "pipe")
    with pytest.raises(InvalidMediaURL, match="is not a regular file"):  # refused without blocking on open
        run(load_images([str(allowed / "pipe")], config))
    (allowed / "notes.txt").write_text("not an image")
    with pytest.raises(UnsupportedMediaType) as caught:
        run(load_images([str(allowed / "notes.txt")], config))
    assert caught.value.status == 415


def test_relative_paths_and_remote_file_urls_are_invalid(media):
    allowed, _ = media
    config = MediaConfig(allowed_local_media_path=str(allowed))
    with pytest.raises(InvalidMediaURL, match="unsupported image URL"):
        run(load_images(["green.png"], config))
    with pytest.raises(InvalidMediaURL, match="file URLs must name a local path"):
        run(load_images(["file://server/share/green.png"], config))


def test_config_requires_an_absolute_directory():
    with pytest.raises(ValueError, match="must be an absolute path"):
        MediaConfig(allowed_local_media_path="relative/dir")
    assert MediaConfig(allowed_local_media_path="").allowed_local_media_path is None
