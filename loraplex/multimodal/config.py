"""MediaConfig: what the server may fetch and how large an image may be (vLLM's option names).

Every default refuses what it does not need: no local files, no http(s) hosts, no private addresses.
Data URLs (`data:image/...;base64,...`) are always accepted, within the size limits.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from loraplex.multimodal.budget import DecodeBudget


def normalise_host(host: str) -> str:
    """The form hosts are compared in: lowercase ASCII (IDNA), no trailing dot, IPv6 without brackets."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))  # one spelling per address: "::0:1" -> "::1"
    except ValueError:
        pass
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise ValueError(f"not a valid host name: {host!r}") from exc


@dataclass(frozen=True)
class MediaConfig:
    # A directory (absolute). Images may be read from files inside it, symlinks resolved first.
    # None (or "") refuses `file://` URLs and local paths altogether.
    allowed_local_media_path: str | None = None
    # Hosts (names or literal IPs) that http:// and https:// images may come from: exact match only,
    # so `example.com` does not admit `cdn.example.com` (list each one). Empty refuses http(s).
    allowed_media_domains: tuple[str, ...] = ()
    # A listed host must still resolve only to public addresses. True lets listed hosts resolve to
    # loopback, private (RFC 1918, fc00::/7), link-local, shared and reserved ranges: for operators
    # who list their own internal image store. Unspecified (0.0.0.0, ::) and multicast addresses
    # are never connected to.
    allow_private_addresses: bool = False
    # Encoded size of one image, as fetched (20 MiB: OpenAI's own limit per image).
    max_image_bytes: int = 20 * 1024 * 1024
    # Width x height of one image, read from its header before decoding. 4096 x 4096 (16.8 MP)
    # admits 12 MP phone photos and 5K screenshots; decoded RGB is then at most 48 MiB per image.
    # Pillow refuses more than 2 x Image.MAX_IMAGE_PIXELS (~179 MP) whatever is set here.
    max_image_pixels: int = 4096 * 4096
    # Images in one request (all messages together), counted before any is fetched.
    max_images_per_request: int = 8
    # Whole-fetch deadline for one http(s) image: name lookup, connect, redirects and body.
    fetch_timeout_s: float = 10.0
    # Redirects followed per image; each target is checked like the original URL. 0 refuses them.
    max_redirects: int = 3
    # Decoded size of one request's images together (width x height x 3 bytes of RGB each), counted
    # from their headers before any is decoded; more is refused (413). 512 MiB admits the largest
    # request the limits above allow (8 images of 4096 x 4096: 384 MiB).
    max_decoded_bytes_per_request: int = 512 * 1024 * 1024
    # Decoded size of all requests' images at once, server-wide: a request whose images do not fit
    # beside those being decoded and processed waits for them (first come first served); one that could
    # never fit is refused (413). 1 GiB: two of the largest requests at a time, not every request at once.
    max_decoded_bytes_total: int = 1024 * 1024 * 1024

    # Derived: allowed_media_domains normalised for comparison.
    allowed_hosts: frozenset[str] = field(init=False, repr=False, compare=False)
    # The server-wide budget of max_decoded_bytes_total, one per MediaConfig (one per server).
    decode_budget: DecodeBudget = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        local = self.allowed_local_media_path or None
        if local is not None and not os.path.isabs(local):
            raise ValueError(f"allowed_local_media_path must be an absolute path, not {local!r}")
        domains = (self.allowed_media_domains,) if isinstance(self.allowed_media_domains, str) else self.allowed_media_domains
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request",
                     "max_decoded_bytes_per_request", "max_decoded_bytes_total"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be positive, not {self.fetch_timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be 0 or more, not {self.max_redirects}")
        object.__setattr__(self, "allowed_local_media_path", local)
        object.__setattr__(self, "allowed_media_domains", tuple(domains))
        object.__setattr__(self, "allowed_hosts", frozenset(normalise_host(d) for d in domains))
        object.__setattr__(self, "decode_budget", DecodeBudget(self.max_decoded_bytes_total))
