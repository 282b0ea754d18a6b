"""http(s) images against a local server on 127.0.0.1: allow-list, private addresses, redirects,
timeouts and the byte cap. Nothing leaves the machine: other names are answered by a fake resolver."""

import asyncio
import socket

import pytest

from loraplex.multimodal import (
    InvalidMediaURL,
    MediaConfig,
    MediaFetchError,
    MediaFetchTimeout,
    MediaNotAllowed,
    MediaTooLarge,
    UnsupportedMediaType,
    fetch_image_bytes,
    load_images,
)

from . import servers
from .aio import run
from .images import GREEN

LOCAL = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, fetch_timeout_s=5)


@pytest.fixture(scope="module")
def server():
    server = servers.start()
    yield server
    servers.stop(server)


def refused(exc_type, url, config):
    with pytest.raises(exc_type) as caught:
        run(load_images([url], config))
    return caught.value


def test_http_is_off_by_default(server):
    error = refused(MediaNotAllowed, server.url("/green.png?case=default"), MediaConfig())
    assert error.status == 400
    assert str(error) == "image 1 of 1: image URLs over http(s) are not allowed (the server has no allowed_media_domains)"
    assert "/green.png?case=default" not in server.paths()  # refused without connecting


def test_host_not_on_the_list(server):
    config = MediaConfig(allowed_media_domains=("images.example.com",))
    error = refused(MediaNotAllowed, server.url("/green.png?case=unlisted"), config)
    assert "image host '127.0.0.1' is not in allowed_media_domains" in str(error)
    assert "/green.png?case=unlisted" not in server.paths()


def test_loopback_is_refused_unless_listed(server):
    config = MediaConfig(allowed_media_domains=("localhost",))  # a name, not the address: refused
    error = refused(MediaNotAllowed, server.url("/green.png?case=private").replace("127.0.0.1", "localhost"), config)
    assert error.status == 400 and "loopback address 127.0.0.1 (allow_private_addresses is off)" in str(error)
    assert not any("case=private" in path for path in server.paths())


def test_a_listed_loopback_address_is_served(server):
    config = MediaConfig(allowed_media_domains=("127.0.0.1",))  # the operator listed the address itself
    [image] = run(load_images([server.url("/green.png?case=literal")], config))
    assert image.size == (8, 6) and image.getpixel((7, 5)) == GREEN


def test_listed_loopback_is_served_with_the_private_switch(server):
    [image] = run(load_images([server.url("/green.png?case=served")], LOCAL))
    assert image.size == (8, 6) and image.getpixel((7, 5)) == GREEN
    assert ("/green.png?case=served", f"127.0.0.1:{server.port}") in server.seen


def test_a_name_that_resolves_to_loopback(server):
    url = server.url("/green.png?case=localhost", host="localhost")
    error = refused(MediaNotAllowed, url, MediaConfig(allowed_media_domains=("localhost",)))
    assert "image host 'localhost' resolves to loopback address" in str(error)
    config = MediaConfig(allowed_media_domains=("LocalHost.",), allow_private_addresses=True, fetch_timeout_s=5)
    [image] = run(load_images([url], config))  # ::1 may come first and be refused: the next address is tried
    assert image.getpixel((0, 0)) == GREEN


def test_redirect_on_the_allowed_host_is_followed(server):
    [image] = run(load_images([server.url("/hop?case=ok")], LOCAL))
    assert image.size == (8, 6)
    paths = server.paths()
    assert paths[paths.index("/hop?case=ok") + 1] == "/green.png"


def test_redirect_off_the_list_is_refused(server):
    before = len(server.seen)
    error = refused(MediaNotAllowed, server.url("/away"), LOCAL)
    assert str(error) == (
        f"image 1 of 1: {server.url('/away')} redirected to {server.url('/green.png', host='localhost')}: "
        "image host 'localhost' is not in allowed_media_domains"
    )
    assert server.paths()[before:] == ["/away"]  # the target was never requested


def test_redirect_to_a_file_url_is_refused(server):
    error = refused(InvalidMediaURL, server.url("/to-file"), LOCAL)
    assert "redirected to file:///etc/passwd: only http and https image URLs can be fetched" in str(error)


def test_redirect_limit(server):
    before = len(server.seen)
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, max_redirects=2)
    error = refused(MediaFetchError, server.url("/loop"), config)
    assert error.status == 422
    assert str(error).endswith("redirected more than max_redirects = 2 times")
    assert server.paths()[before:] == ["/loop"] * 3
    no_redirects = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, max_redirects=0)
    assert "max_redirects = 0" in str(refused(MediaFetchError, server.url("/hop"), no_redirects))


def test_a_server_that_never_answers_times_out(server):
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, fetch_timeout_s=0.3)
    error = refused(MediaFetchTimeout, server.url("/silent"), config)
    assert error.status == 422
    assert str(error) == f"image 1 of 1: fetching {server.url('/silent')} took longer than fetch_timeout_s = 0.3 s"


def test_a_dripping_body_hits_the_whole_fetch_deadline(server):
    # Every read returns within the per-read timeout; only the overall deadline ends this.
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, fetch_timeout_s=0.5)
    refused(MediaFetchTimeout, server.url("/drip"), config)


def test_an_endless_body_is_cut_off_at_the_cap(server):
    cap = 100_000
    config = MediaConfig(allowed_media_domains=("127.0.0.1",), allow_private_addresses=True, max_image_bytes=cap)
    error = refused(MediaTooLarge, server.url("/endless"), config)
    assert error.status == 413 and error.limit == "max_image_bytes" and error.limit_value == cap
    read = int(str(error).split("cut off after ")[1].split(" bytes")[0])
    assert cap < read <= cap + 65536  # stopped within one chunk of the cap
    assert str(error).endswith("the limit is max_image_bytes = 100000 bytes")


def test_a_declared_length_over_the_cap_is_refused_before_reading(server):
    error = refused(MediaTooLarge, server.url("/declared-big"), LOCAL)
    assert "image response declares 1000000000 bytes (Content-Length); the limit is max_image_bytes = 20971520 bytes" in str(error)


def test_upstream_errors(server):
    assert "answered HTTP 404" in str(refused(MediaFetchError, server.url("/nothing-here"), LOCAL))
    assert refused(UnsupportedMediaType, server.url("/text"), LOCAL).status == 415
    assert "Content-Encoding 'gzip'" in str(refused(MediaFetchError, server.url("/gzip"), LOCAL))


def test_connection_refused():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    error = refused(MediaFetchError, f"http://127.0.0.1:{port}/x.png", LOCAL)
    assert error.status == 422 and "cannot fetch" in str(error)


async def with_resolver(answers: dict[str, list[list[str]]], coroutine_fn):
    """Run with names in `answers` resolved by a fake (one list of addresses per lookup, in turn);
    returns (result or exception, the names looked up)."""
    loop = asyncio.get_running_loop()
    real, looked_up = loop.getaddrinfo, []

    async def fake(host, port, *args, **kwargs):
        looked_up.append(host)
        if host in answers:
            if not answers[host]:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answers[host].pop(0)]
        return await real(host, port, *args, **kwargs)

    loop.getaddrinfo = fake
    try:
        return await coroutine_fn(), looked_up
    except Exception as exc:  # noqa: BLE001 - handed back for the test to inspect
        return exc, looked_up


def test_connects_to_the_address_it_checked(server):
    """DNS rebinding: a second lookup would answer 10.0.0.1; there is none."""
    url = server.url("/green.png?case=rebind", host="images.test")
    config = MediaConfig(allowed_media_domains=("images.test",), allow_private_addresses=True, fetch_timeout_s=5)
    answers = {"images.test": [["127.0.0.1"], ["10.0.0.1"]]}
    data, looked_up = run(with_resolver(answers, lambda: fetch_image_bytes(url, config)))
    assert data == servers.GREEN_PNG
    assert looked_up.count("images.test") == 1
    assert ("/green.png?case=rebind", f"images.test:{server.port}") in server.seen  # Host is the name


def test_a_name_with_any_private_address_is_refused_whole():
    config = MediaConfig(allowed_media_domains=("mixed.test",))
    answers = {"mixed.test": [["93.184.216.34", "169.254.169.254"]]}
    error, _ = run(with_resolver(answers, lambda: fetch_image_bytes("http://mixed.test/x.png", config)))
    assert isinstance(error, MediaNotAllowed)
    assert str(error) == (
        "image host 'mixed.test' resolves to link-local address 169.254.169.254 (allow_private_addresses is off)"
    )


def test_multicast_is_refused_even_with_the_private_switch():
    config = MediaConfig(allowed_media_domains=("group.test",), allow_private_addresses=True)
    error, _ = run(with_resolver({"group.test": [["224.0.0.1"]]}, lambda: fetch_image_bytes("http://group.test/", config)))
    assert isinstance(error, MediaNotAllowed) and str(error) == "image host 'group.test' resolves to multicast address 224.0.0.1"


def test_an_unresolvable_name():
    config = MediaConfig(allowed_media_domains=("gone.test",))
    error, _ = run(with_resolver({"gone.test": []}, lambda: fetch_image_bytes("http://gone.test/x.png", config)))
    assert isinstance(error, MediaFetchError) and error.status == 422
    assert "image host 'gone.test' cannot be resolved" in str(error)


def test_https_goes_through_tls(server):
    # The local server speaks plain HTTP: the TLS handshake fails, and says so.
    error = refused(MediaFetchError, server.url("/green.png").replace("http:", "https:"), LOCAL)
    assert error.status == 422 and "SSL" in str(error)
