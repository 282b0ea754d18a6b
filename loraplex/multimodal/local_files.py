"""Local images (`file://...` or an absolute path), only from inside allowed_local_media_path.

The path is resolved (symlinks followed, `..` removed) before the containment check, so a symlink
inside the directory that points outside it is refused. A path outside is refused whether or not it
exists, so the check reveals nothing about the rest of the file system. The size is read from the
open file before any byte is read. Blocking: callers on an event loop run this in a thread.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import unquote, urlsplit

from loraplex.multimodal.config import MediaConfig
from loraplex.multimodal.errors import InvalidMediaURL, MediaFetchError, MediaNotAllowed, over_byte_limit, shorten


def local_path(url: str) -> str:
    """The file system path a `file://` URL or absolute path names."""
    if not url.startswith("file:"):
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidMediaURL(f"file URLs must name a local path (file:///...), not host {parts.netloc!r}")
    if parts.query or parts.fragment:
        raise InvalidMediaURL(f"file URLs take no query or fragment: {shorten(url)}")
    return unquote(parts.path)


def read_local_file(url: str, config: MediaConfig) -> bytes:
    if config.allowed_local_media_path is None:
        raise MediaNotAllowed("local image files are not allowed (the server has no allowed_local_media_path)")
    path = local_path(url)
    if not os.path.isabs(path) or "\0" in path:
        raise InvalidMediaURL(f"local image paths must be absolute: {shorten(url)}")
    root = os.path.realpath(config.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise MediaNotAllowed(f"local image path {shorten(path)!r} is outside allowed_local_media_path")
    try:
        # O_NOFOLLOW: `real` has no symlinks; one swapped in since realpath() is refused, not followed.
        # O_NONBLOCK: opening a FIFO must not hang; it is refused below as not a regular file.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MediaFetchError(f"local image {shorten(path)!r} does not exist") from None
    except OSError as exc:
        raise MediaFetchError(f"local image {shorten(path)!r} cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidMediaURL(f"local image {shorten(path)!r} is not a regular file")
        if info.st_size > config.max_image_bytes:
            raise over_byte_limit(f"local image is {info.st_size} bytes", config.max_image_bytes)
        data = file.read(config.max_image_bytes + 1)  # +1: a file that grew since fstat is caught
    if len(data) > config.max_image_bytes:
        raise over_byte_limit("local image grew past the limit while being read", config.max_image_bytes)
    return data
