"""load_images: the server's one call. Count first, then every image fetched and decoded, in order."""

import asyncio

import pytest

from loraplex.multimodal import InvalidMediaURL, MediaConfig, MediaTooLarge, check_image_count, load_images

from . import servers
from .aio import run
from .images import BLUE, GREEN, RED, data_url, encode


@pytest.fixture(scope="module")
def server():
    server = servers.start()
    yield server
    servers.stop(server)


def test_too_many_images_are_refused_before_any_fetch(server):
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, max_images_per_request=8)
    urls = [server.url(f"/green.png?count={i}") for i in range(9)]
    with pytest.raises(MediaTooLarge) as caught:
        run(load_images(urls, config))
    assert caught.value.status == 413
    assert caught.value.limit == "max_images_per_request" and caught.value.limit_value == 8
    assert str(caught.value) == "request has 9 images; the limit is max_images_per_request = 8"
    assert not any("count=" in path for path in server.paths())
    check_image_count(8, config)  # eight is fine


def test_images_from_every_source_come_back_in_order(server, tmp_path):
    (tmp_path / "blue.png").write_bytes(encode("PNG", size=(2, 9), color=BLUE))
    config = MediaConfig(
        allowed_local_media_path=str(tmp_path),
        allowed_media_domains=("127.0.0.1",),
        allow_private_addresses=True,
        fetch_timeout_s=5,
    )
    urls = [
        data_url(encode("PNG", size=(1, 1), color=RED)),
        server.url("/green.png?order"),
        str(tmp_path / "blue.png"),
        data_url(encode("GIF", size=(3, 3), color=RED), "image/gif"),
    ]
    images = run(load_images(urls, config))
    assert [(i.size, i.getpixel((0, 0))) for i in images] == [((1, 1), RED), ((8, 6), GREEN), ((2, 9), BLUE), ((3, 3), RED)]


def test_no_images_is_an_empty_list():
    assert run(load_images([], MediaConfig())) == []


def test_the_first_failure_names_its_image_and_stops_the_others(server):
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, fetch_timeout_s=30)

    async def scenario():
        load = asyncio.create_task(load_images([server.url("/silent"), "data:image/png;base64,@@@@"], config))
        with pytest.raises(InvalidMediaURL) as caught:
            await load
        # The fetch still waiting on /silent was cancelled: nothing of ours is left running.
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return caught.value, left

    error, left = run(scenario())
    assert str(error).startswith("image 2 of 2: data URL is not valid base64")
    assert left == []
