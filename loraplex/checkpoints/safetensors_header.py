"""Check a safetensors file's header before any tensor is read.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}`, offsets relative to the data section), then the
data section. The format requires what is checked here: every tensor's byte range is exactly its shape times
its dtype's size, and the ranges, sorted, tile the data section with neither overlaps nor holes.

A file that lies (a shape of 2**80 elements over a few bytes, offsets past the end, two tensors sharing
bytes) is refused here, before safetensors or torch allocate anything from what it says. Only the header
is read, and only once its length is checked against a bound and the file's size. Messages name the
tensor, never the file's path (the caller says which file, in the words its reader may see).
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from dataclasses import dataclass

MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on N
MAX_DIMS = 64  # far above any real tensor; keeps the size arithmetic small

# Bytes per element of each dtype safetensors.torch loads; anything else is refused.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F16", "BF16", "F32", "F64"})


class SafetensorsHeaderError(ValueError):
    """The file is not a well-formed safetensors file; the message says what is wrong (and with which tensor)."""


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as the header describes it (checked: its bytes are in the file and its own)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets in the data section
    end: int

    @property
    def floating(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def read_header(path: str | os.PathLike, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, TensorHeader]:
    """The checked header of a safetensors file: name -> TensorHeader (in file order).

    Raises SafetensorsHeaderError for a malformed or lying header, OSError when the file cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsHeaderError(f"the file has {size} bytes, fewer than the 8 of the header length")
        n = int.from_bytes(prefix, "little")
        if n > max_header_bytes:
            raise SafetensorsHeaderError(f"the header length {n} is beyond the bound of {max_header_bytes} bytes")
        if n > size - 8:
            raise SafetensorsHeaderError(f"the header length {n} is beyond the end of the file ({size} bytes)")
        raw = f.read(n)
    return check_header(raw, size - 8 - n)


def read_owned(path: str | os.PathLike, header: dict[str, TensorHeader],
               max_header_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """The whole file, read into memory this process owns, and checked to be the file `header` (read_header's) was
    read from: its own header equal, its length what that header says.

    Never memory-mapped: a file truncated or replaced in place under a mapping (`cp new over/an/adapter`) kills
    the process with SIGBUS at the first read of a page that is gone. Raises SafetensorsHeaderError when the file
    changed since its header was read, OSError when it cannot be read."""
    data_bytes = max((t.end for t in header.values()), default=0)
    with open(path, "rb") as f:
        data = f.read(8 + max_header_bytes + data_bytes + 1)  # a file longer than its header allows stops here
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    changed = SafetensorsHeaderError("the file changed while it was being read")
    if not 0 <= n <= max_header_bytes or len(data) != 8 + n + data_bytes:
        raise changed
    try:
        again = check_header(data[8:8 + n], data_bytes)
    except SafetensorsHeaderError:
        raise changed from None
    if again != header:
        raise changed
    return data


def owned_tensors(data: bytes, header: dict[str, TensorHeader]) -> dict:
    """The tensors of a file read by `read_owned`, as views of its bytes (nothing copied: a cold adapter's tensors
    are read without holding the interpreter for a copy of the file, as safetensors' own `load` does). Read-only:
    the bytes are immutable (copy a tensor before writing to it)."""
    import warnings

    import torch

    torch_dtypes = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
                    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "I16": torch.int16, "U16": torch.uint16,
                    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                    "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
                    "C64": torch.complex64}
    start = 8 + int.from_bytes(data[:8], "little")
    tensors = {}
    with warnings.catch_warnings():  # "the given buffer is not writable": the views are only read
        warnings.simplefilter("ignore", UserWarning)
        for name, t in header.items():
            dtype = torch_dtypes[t.dtype]
            if t.end == t.begin:
                tensors[name] = torch.empty(t.shape, dtype=dtype)
            else:
                count = (t.end - t.begin) // dtype.itemsize
                tensors[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=start + t.begin).view(t.shape)
    return tensors


def check_header(raw: bytes, data_bytes: int) -> dict[str, TensorHeader]:
    """Check header JSON `raw` against a data section of `data_bytes` bytes (see `read_header`)."""
    header = _parse(raw)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):  # JSON object keys are always strings
        raise SafetensorsHeaderError(f"__metadata__ must map strings to strings; got {_short(metadata)}")
    tensors = {name: _tensor(name, entry, data_bytes) for name, entry in header.items()}
    covered, last = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < covered:
            raise SafetensorsHeaderError(
                f"tensor {_short(t.name)}: its bytes [{t.begin}, {t.end}) overlap those of tensor {_short(last)}"
            )
        if t.begin > covered:
            raise SafetensorsHeaderError(
                f"tensor {_short(t.name)}: its bytes start at {t.begin}, leaving a hole after byte {covered} of the data"
            )
        covered, last = t.end, t.name
    if covered != data_bytes:
        raise SafetensorsHeaderError(f"the tensors cover {covered} of the data section's {data_bytes} bytes")
    return tensors


def _parse(raw: bytes) -> dict:
    def unique(pairs: list[tuple[str, object]]) -> dict:
        entries: dict = {}
        for key, value in pairs:
            if key in entries:  # a second entry under one name could hide a lie in the first
                raise SafetensorsHeaderError(f"the header names {_short(key)} twice")
            entries[key] = value
        return entries

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except RecursionError:
        raise SafetensorsHeaderError("the header JSON is nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsHeaderError(f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError("the header is not a JSON object")
    return header


def _tensor(name: str, entry: object, data_bytes: int) -> TensorHeader:
    def refuse(why: str) -> SafetensorsHeaderError:
        return SafetensorsHeaderError(f"tensor {_short(name)}: {why}")

    if not isinstance(entry, dict):
        raise refuse(f"its entry is not an object ({_short(entry)})")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise refuse(f"unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_uint(d) for d in shape):
        raise refuse(f"shape {_short(shape)} is not a list of at most {MAX_DIMS} non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_uint(o) for o in offsets)):
        raise refuse(f"data_offsets {_short(offsets)} is not a pair of non-negative integers")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise refuse(f"data_offsets [{begin}, {end}] are not within the data section's {data_bytes} bytes")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]  # Python integers: no overflow (at most MAX_DIMS factors)
    if nbytes != end - begin:
        raise refuse(f"shape {shape} of {dtype} takes {nbytes} bytes but its data_offsets span {end - begin}")
    return TensorHeader(name, dtype, tuple(shape), begin, end)


def _uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _short(value: object) -> str:
    """A bounded repr: a lying header's values can be megabytes long or deeply nested."""
    return _REPR.repr(value)
