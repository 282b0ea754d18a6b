"""Safetensors files crafted byte by byte, each telling one lie (shared by the adapter and model-weight tests),
and a guard that fails a test if safetensors is asked to read one of them."""

from __future__ import annotations

import contextlib
import json
import resource
import struct

import pytest

ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}  # a 2x2 float32 tensor
DATA = bytes(16)


def craft(header: dict | bytes, data: bytes = DATA, length: int | None = None) -> bytes:
    """8-byte little-endian header length (`length`, else the true one), the header (JSON unless bytes), data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def one(entry: object, data: bytes = DATA) -> bytes:
    return craft({"t": entry}, data)


# (id, file bytes, words the refusal must contain)
LIES = [
    ("shorter-than-8-bytes", b"\x01\x02", "fewer than the 8"),
    ("header-length-past-end", craft({"t": ENTRY}, length=4096), "beyond the end of the file"),
    ("header-length-past-bound", craft({"t": ENTRY}, length=2**62), "beyond the bound"),
    ("invalid-json", craft(b"{not json"), "not valid JSON"),
    ("not-utf8", craft(b'{"\xff": 1}'), "not valid JSON"),
    ("header-not-object", craft(b"[1, 2]"), "not a JSON object"),
    ("nested-100000-deep", craft(b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    ("duplicate-name", craft(b'{"t": %s, "t": %s}' % ((json.dumps(ENTRY).encode(),) * 2)), "'t' twice"),
    ("huge-shape", one({**ENTRY, "shape": [2**40, 2**40]}), "takes 4835703278458516698824704 bytes"),
    ("dim-beyond-int64", one({**ENTRY, "shape": [2**70, 0]}, b""), "non-negative integers"),
    ("negative-dims", one({**ENTRY, "shape": [-2, -2]}), "non-negative integers"),
    ("float-dim", one({**ENTRY, "shape": [2.0, 2]}), "non-negative integers"),
    ("shape-not-a-list", one({**ENTRY, "shape": "2x2"}), "non-negative integers"),
    ("too-many-dims", one({**ENTRY, "shape": [1] * 65 + [4]}), "at most 64"),
    ("size-mismatch", one({**ENTRY, "shape": [2, 3]}), "takes 24 bytes but its data_offsets span 16"),
    ("dtype-mismatch", one({**ENTRY, "dtype": "F64"}), "takes 32 bytes"),
    ("unknown-dtype", one({**ENTRY, "dtype": "F128"}), "unknown dtype 'F128'"),
    ("offsets-past-end", one({**ENTRY, "shape": [2**30], "data_offsets": [0, 2**32]}), "not within the data section"),
    ("offsets-reversed", one({**ENTRY, "data_offsets": [16, 0]}), "not within the data section"),
    ("offsets-not-a-pair", one({**ENTRY, "data_offsets": [0]}), "not a pair"),
    ("entry-not-an-object", one([1, 2]), "not an object"),
    ("overlapping-ranges", craft({"a": ENTRY, "b": {**ENTRY, "data_offsets": [8, 24]}}, bytes(24)), "overlap"),
    ("hole-between", craft({"a": ENTRY, "b": {**ENTRY, "data_offsets": [20, 36]}}, bytes(36)), "hole after byte 16"),
    ("bytes-after-the-last", one(ENTRY, DATA + bytes(8)), "cover 16 of the data section's 24 bytes"),
    ("metadata-values-not-strings", craft({"__metadata__": {"format": 1}, "t": ENTRY}), "__metadata__"),
    ("metadata-not-an-object", craft({"__metadata__": "pt", "t": ENTRY}), "__metadata__"),
]
LIE_PARAMS = [pytest.param(data, words, id=name) for name, data, words in LIES]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


@contextlib.contextmanager
def nothing_read(monkeypatch, module, *names: str, max_growth_mb: float = 200):
    """Inside: calling `module.<name>` fails the test (the refusal must come first), and the process's peak
    RSS may not grow by more than `max_growth_mb` (nothing allocated from a lying size)."""

    def reached(*args, **kwargs):
        raise AssertionError("safetensors was asked to read a file whose header lies")

    for name in names:
        monkeypatch.setattr(module, name, reached)
    before = peak_rss_mb()
    yield
    assert peak_rss_mb() - before < max_growth_mb
