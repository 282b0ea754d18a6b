"""http(s) images: connect only to checked addresses, follow redirects by hand, cap bytes and time.

Built on httpcore (the transport under httpx) because it lets us own the network layer: the host
name is resolved and checked at the moment of connecting, and the socket goes to an address that
passed, so no second DNS lookup can answer differently between check and connect (DNS rebinding).
No proxy settings from the environment are used (they would connect elsewhere). HTTP/1.1 only.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from urllib.parse import urljoin

import httpcore
import httpx

from loraplex.multimodal.addresses import HttpTarget, check_http_url, resolve_checked
from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.errors import (
    InvalidMediaURL,
    MediaFetchError,
    MediaFetchTimeout,
    MediaNotAllowed,
    over_byte_limit,
    shorten,
)

REDIRECTS = frozenset({301, 302, 303, 307, 308})


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """certifi's CA bundle, host names checked: as httpx does. Built on first use (it reads the bundle)."""
    return httpx.create_ssl_context()


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network layer with the address check inside connect_tcp."""

    def __init__(self, config: MediaConfig) -> None:
        self._config = config
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        error: Exception | None = None
        for address in await resolve_checked(host, port, self._config):
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc  # try the next checked address
        assert error is not None  # resolve_checked returns at least one address
        raise error

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise MediaNotAllowed("images are not fetched over unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def fetch_http(url: str, config: MediaConfig) -> bytes:
    """The body of an http(s) image URL, within fetch_timeout_s for the whole fetch (lookup, connect,
    every redirect, body) and max_image_bytes for the body."""
    try:
        async with asyncio.timeout(config.fetch_timeout_s):
            return await _fetch(url, config)
    except (TimeoutError, httpcore.TimeoutException):
        raise MediaFetchTimeout(
            f"fetching {shorten(url)} took longer than fetch_timeout_s = {config.fetch_timeout_s} s"
        ) from None
    except httpcore.NetworkError as exc:  # refused, reset, unreachable, TLS certificate refused
        raise MediaFetchError(f"cannot fetch {shorten(url)}: {exc or type(exc).__name__}") from None
    except httpcore.ProtocolError as exc:  # the other end does not speak HTTP/1.1
        raise MediaFetchError(f"cannot fetch {shorten(url)}: bad HTTP response ({exc})") from None


async def _fetch(url: str, config: MediaConfig) -> bytes:
    pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context(), network_backend=CheckedBackend(config), retries=0)
    async with pool:
        current, previous = url, None
        for _ in range(config.max_redirects + 1):
            target = _check(current, previous, config)
            async with pool.stream("GET", _url(target), headers=_headers(target), extensions=_extensions(config)) as response:
                if response.status in REDIRECTS:
                    location = _header(response, b"location")
                    if not location:
                        raise MediaFetchError(f"{shorten(current)} answered HTTP {response.status} without a Location")
                    current, previous = urljoin(current, location), current
                    continue
                if response.status != 200:
                    raise MediaFetchError(f"{shorten(current)} answered HTTP {response.status}")
                return await _read_capped(response, config.max_image_bytes)
    raise MediaFetchError(f"{shorten(url)} redirected more than max_redirects = {config.max_redirects} times")


def _check(url: str, redirected_from: str | None, config: MediaConfig) -> HttpTarget:
    """check_http_url, with a redirect's refusal saying where it came from."""
    try:
        return check_http_url(url, config)
    except (InvalidMediaURL, MediaNotAllowed) as exc:
        if redirected_from is None:
            raise
        raise exc.located(f"{shorten(redirected_from)} redirected to {shorten(url)}") from None


async def _read_capped(response: httpcore.Response, max_bytes: int) -> bytes:
    """The body, refused once it passes max_bytes (reading stops there; the connection is dropped)."""
    encoding = _header(response, b"content-encoding")
    if encoding and encoding.lower() != "identity":  # we asked for identity; images are compressed already
        raise MediaFetchError(f"image response uses Content-Encoding {encoding!r}; only identity is accepted")
    declared = _header(response, b"content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise over_byte_limit(f"image response declares {declared} bytes (Content-Length)", max_bytes)
    chunks, size = [], 0
    async for chunk in response.aiter_stream():
        size += len(chunk)
        if size > max_bytes:
            raise over_byte_limit(f"image response was cut off after {size} bytes", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _url(target: HttpTarget) -> httpcore.URL:
    # From checked parts, never from the raw string: what we connect to is what we checked.
    return httpcore.URL(scheme=target.scheme, host=target.host, port=target.port, target=target.target)


def _headers(target: HttpTarget) -> list[tuple[str, str]]:
    return [
        ("Host", target.host_header),
        ("User-Agent", "loraplex"),
        ("Accept", "image/*"),
        ("Accept-Encoding", "identity"),
    ]


def _extensions(config: MediaConfig) -> dict:
    t = config.fetch_timeout_s  # per operation; the overall deadline is in fetch_http
    return {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}


def _header(response: httpcore.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None
