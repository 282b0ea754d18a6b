"""Which http(s) URLs and which IP addresses an image may be fetched from.

Two checks, both needed: the host must be listed in allowed_media_domains (exact match after
normalising; subdomains are not implied), and every address the host resolves to must be public,
unless the operator listed that address itself (a literal IP such as 127.0.0.1) or set
allow_private_addresses, which admits listed host names that resolve to loopback, private,
link-local, shared or reserved ranges. Unspecified and multicast addresses are
never connected to. IPv6 addresses that carry an IPv4 address (IPv4-mapped, NAT64 64:ff9b::/96) are
judged by the IPv4 address inside; 6to4 (2002::/16) by both.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from typing import NamedTuple
from urllib.parse import quote, urlsplit

from loraplex.multimodal.config import MediaConfig, normalise_host
from loraplex.multimodal.errors import InvalidMediaURL, MediaFetchError, MediaNotAllowed, shorten

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NEVER = ("unspecified", "multicast")  # not even with allow_private_addresses
NON_PUBLIC = ("loopback", "link_local", "site_local", "reserved", "private")  # most specific first
PATH_SAFE = "/%:@!$&'()*+,;=-._~"  # RFC 3986 pchar and '/': kept; anything else percent-encoded
QUERY_SAFE = PATH_SAFE + "?"


class HttpTarget(NamedTuple):
    """A checked http(s) URL, taken apart: only these pieces are used to connect."""

    scheme: str  # "http" | "https"
    host: str  # normalised: lowercase IDNA name or an IP without brackets
    port: int
    target: str  # path and query, percent-encoded

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def check_http_url(url: str, config: MediaConfig) -> HttpTarget:
    """Parse an http(s) URL and check its host against allowed_media_domains (no network)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidMediaURL(f"only http and https image URLs can be fetched: {shorten(url)}")
    if parts.username is not None or parts.password is not None:
        raise InvalidMediaURL(f"image URLs must not carry user names or passwords: {shorten(url)}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = normalise_host(parts.hostname or "")
    except ValueError:
        raise InvalidMediaURL(f"image URL has an invalid host or port: {shorten(url)}") from None
    if not host or not (_is_ip(host) or HOST_NAME.fullmatch(host)):
        raise InvalidMediaURL(f"image URL has an invalid host: {shorten(url)}")
    if host not in config.allowed_hosts:
        if not config.allowed_hosts:
            raise MediaNotAllowed("image URLs over http(s) are not allowed (the server has no allowed_media_domains)")
        raise MediaNotAllowed(f"image host {host!r} is not in allowed_media_domains")
    target = quote(parts.path or "/", safe=PATH_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=QUERY_SAFE)
    return HttpTarget(parts.scheme, host, port, target)


def refusal(ip: IPAddress, allow_private: bool) -> str | None:
    """Why we will not connect to `ip` ("loopback", ...), or None when we will."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in NAT64 else None)
        if inner is not None:  # the packets go to the IPv4 address inside: judge that alone
            reason = refusal(inner, allow_private)
            return f"{reason} (inside {ip})" if reason else None
        if ip.sixtofour is not None:  # a global address, but one a relay unwraps: judge both
            reason = refusal(ip.sixtofour, allow_private)
            if reason:
                return f"{reason} (inside {ip})"
    for kind in NEVER:
        if getattr(ip, f"is_{kind}"):
            return kind
    if allow_private:
        return None
    for kind in NON_PUBLIC:
        if getattr(ip, f"is_{kind}", False):  # IPv4 has no is_site_local
            return kind.replace("_", "-")
    if not ip.is_global:  # e.g. 100.64.0.0/10 (carrier-grade NAT), not covered by is_private
        return "not global"
    return None


async def resolve_checked(host: str, port: int, config: MediaConfig) -> list[str]:
    """The addresses to connect to, all of them checked. A name with any refused address is refused
    whole: one public and one private answer is what a rebinding attack looks like."""
    if _is_ip(host):
        found = [host]
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise MediaFetchError(f"image host {host!r} cannot be resolved ({exc.strerror})") from None
        found = list(dict.fromkeys(info[4][0] for info in infos))
    for address in found:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
        # A literal address in allowed_media_domains is the operator's own choice: listing it admits it.
        reason = refusal(ip, config.allow_private_addresses or address == host)
        if reason:
            # Say which switch would admit it, when one would.
            hint = " (allow_private_addresses is off)" if refusal(ip, True) is None else ""
            where = f"is a {reason} address" if address == host else f"resolves to {reason} address {address}"
            raise MediaNotAllowed(f"image host {host!r} {where}{hint}")
    return found


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
