"""A GGUF file's scalar metadata, read with ``struct`` alone: no torch, no numpy, no ``gguf``.

``kvwise size`` needs four numbers of a GGUF (layers, heads, KV heads, head dim). The model
path (``kvwise.models.gguf_weights.open_gguf``, then ``ModelArchConfig.from_gguf``) imports
torch. This one walks the key/value section only, keeps the scalars and strings, and skips
each array by its length (a string array: one length read a string), in ~10 ms.

Contract: ``read_scalars(path)`` returns ``{key: value}`` for every key: its value if a scalar
or a string, ``ARRAY`` if an array (not read); or None for a file it does not read (not GGUF,
version 1, big-endian, cut short): the caller falls back to the full reader, which raises the
error a user can act on.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

ARRAY = object()  # the value of a key holding an array (skipped, not read)
_MAGIC = b"GGUF"
_STRING = 8
_ARRAY = 9
# GGUF value types: struct format of each fixed-size one (little-endian)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def read_scalars(path: str | Path) -> dict[str, object] | None:
    """The metadata of the GGUF at ``path``, arrays as ``ARRAY`` (None: a file this does not
    read)."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            return None
    with buf:
        try:
            return _parse(buf)
        except (struct.error, UnicodeDecodeError, IndexError):  # cut short or not GGUF
            return None


def _parse(buf) -> dict[str, object] | None:
    if buf[:4] != _MAGIC:
        return None
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):  # 1 has 32-bit counts; a big-endian file reads as a huge version
        return None
    num_kv = struct.unpack_from("<Q", buf, 16)[0]
    offset = 24
    found: dict[str, object] = {}
    for _ in range(num_kv):
        key, offset = _string(buf, offset)
        (value_type,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        if value_type == _ARRAY:
            offset = _skip_array(buf, offset)
            found[key] = ARRAY
            continue
        value, offset = _value(buf, offset, value_type)
        found[key] = value
    return found


def _string(buf, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    if start + length > len(buf):
        raise IndexError("string past the end of the file")
    return bytes(buf[start : start + length]).decode("utf-8"), start + length


def _value(buf, offset: int, value_type: int) -> tuple[object, int]:
    if value_type == _STRING:
        return _string(buf, offset)
    fmt = _SCALARS.get(value_type)
    if fmt is None:
        raise struct.error(f"unknown GGUF value type {value_type}")
    return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)


def _skip_array(buf, offset: int) -> int:
    element_type, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if element_type == _STRING:
        for _ in range(count):
            offset += 8 + struct.unpack_from("<Q", buf, offset)[0]
        return offset
    if element_type == _ARRAY:
        for _ in range(count):
            offset = _skip_array(buf, offset)
        return offset
    fmt = _SCALARS.get(element_type)
    if fmt is None:
        raise struct.error(f"unknown GGUF value type {element_type}")
    return offset + count * struct.calcsize(fmt)
