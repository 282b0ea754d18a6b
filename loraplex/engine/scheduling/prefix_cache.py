"""Prefix caching's keys: what a full KV block's contents depend on, as a hash chain. Pure Python.

A block's keys and values are a function of every token up to its end, the adapter that computed them,
and anything else the model read on the way (image features or states; an encoder-decoder's encoder
input). So block i's hash is sha256(hash of block i-1, block i's tokens, the digest of the request's
images when the block holds an image placeholder), and block 0's parent is the request's root key:
sha256(adapter's cache identity, cache salt, encoder input). Two requests share a block only when all of
that matches; a salt (vLLM's `cache_salt`) puts a tenant's requests in a cache space of their own, so
another tenant cannot learn from timing which prefixes it holds (CVE-2025-46570).

sha256 rather than Python's `hash`: a collision would hand one request another's keys and values.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array

from loraplex.engine.requests.request import Request


def root_key(adapter_identity: bytes | None, cache_salt: str | None, encoder_ids: list[int] | None) -> bytes:
    digest = hashlib.sha256(b"loraplex-prefix-v1")
    for part in (adapter_identity or b"", (cache_salt or "").encode(), _token_bytes(encoder_ids or [])):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def block_hashes(request: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """The hashes of the request's first `num_blocks` full blocks (extending `request.block_hashes`, which
    stays valid for good: a request's tokens are only ever appended to)."""
    hashes = request.block_hashes
    assert request.cache_key is not None, "the request is not cached"
    assert num_blocks * block_size <= request.num_tokens, "only full blocks have a hash"
    positions = request.images.positions if request.images is not None else ()
    for i in range(len(hashes), num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        digest = hashlib.sha256(hashes[-1] if hashes else request.cache_key)
        digest.update(_token_bytes(request.token_slice(start, end)))
        if _any_in(positions, start, end):
            digest.update(request.image_digest)
        hashes.append(digest.digest())
    return hashes[:num_blocks]


def _any_in(positions, start: int, end: int) -> bool:
    i = bisect.bisect_left(positions, start)
    return i < len(positions) and positions[i] < end


def _token_bytes(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()
