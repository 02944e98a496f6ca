"""KV entries ↔ bytes: a fixed versioned header, then the payload.

One entry holds ``num_blocks`` consecutive blocks of one sequence, starting at block index
``first_block`` of that sequence, as a C-contiguous array
``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` of ``dtype``. It is stored
under the chain hash of its first block and lists the chain hashes of all its blocks, so a
request that shares only the first few of them can still use those (and a chunk written by
another conversation with the same start is recognised as such, never loaded as ours).

Layout (little-endian)::

    magic "KVWS" | version u16 | fixed header size u16 | key 32s | model digest 16s
    | dtype 8s | layers u16 | kv heads u16 | head dim u16 | block size u32 | first block u32
    | num blocks u32 | payload bytes u64 | crc32 of (hashes + payload) u32
    | num_blocks × 32-byte block hashes | payload

``unpack`` checks every field against what this engine expects, so an entry from another
model, KV layout, dtype or format version, a truncated file or a flipped bit is a
``CorruptEntry`` (served as a miss), never wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVWS"
VERSION = 1
_HEADER = struct.Struct("<4sHH32s16s8sHHHIIIQI")
HEADER_SIZE = _HEADER.size

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class CorruptEntry(ValueError):
    """An entry that must not be loaded; the message says why."""


@dataclass(frozen=True)
class EntryFormat:
    """What this engine's entries look like; entries that differ are rejected."""

    model_fingerprint: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype: expected one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def model_digest(self) -> bytes:
        return hashlib.sha256(self.model_fingerprint.encode()).digest()[:16]

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (K and V, every layer)."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * _ITEMSIZE[self.dtype]
        )


@dataclass(frozen=True)
class Entry:
    first_block: int
    block_hashes: list[bytes]
    payload: memoryview  # (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def pack(fmt: EntryFormat, block_hashes: list[bytes], first_block: int, payload) -> bytes:
    """One entry as bytes, keyed by ``block_hashes[0]``. ``payload``: a C-contiguous buffer."""
    view = memoryview(payload).cast("B")
    num_blocks = len(block_hashes)
    if not num_blocks or any(len(h) != 32 for h in block_hashes):
        raise ValueError("block_hashes: expected one or more 32-byte hashes")
    if view.nbytes != num_blocks * fmt.block_bytes:
        raise ValueError(
            f"payload: {view.nbytes} bytes for {num_blocks} blocks of {fmt.block_bytes}"
        )
    hashes = b"".join(block_hashes)
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        block_hashes[0],
        fmt.model_digest,
        fmt.dtype.encode(),
        fmt.num_layers,
        fmt.num_kv_heads,
        fmt.head_dim,
        fmt.block_size,
        first_block,
        num_blocks,
        view.nbytes,
        zlib.crc32(view, zlib.crc32(hashes)),
    )
    return b"".join((header, hashes, view))


def unpack(fmt: EntryFormat, key: bytes, value: bytes | bytearray | memoryview) -> Entry:
    """Check an entry read back under ``key`` and return its payload (no copy).

    Raises:
        CorruptEntry: anything does not match (the reason is in the message).
    """
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptEntry(f"truncated header ({view.nbytes} bytes)")
    (
        magic,
        version,
        header_size,
        entry_key,
        digest,
        dtype,
        num_layers,
        num_kv_heads,
        head_dim,
        block_size,
        first_block,
        num_blocks,
        payload_bytes,
        crc,
    ) = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != VERSION or header_size != HEADER_SIZE:
        raise CorruptEntry(f"format version {version}, expected {VERSION}")
    if entry_key != key:
        raise CorruptEntry("entry stored under another key")
    if digest != fmt.model_digest:
        raise CorruptEntry("entry from another model or KV layout")
    layout = (dtype.rstrip(b"\0").decode(errors="replace"), num_layers, num_kv_heads, head_dim)
    expected = (fmt.dtype, fmt.num_layers, fmt.num_kv_heads, fmt.head_dim)
    if layout != expected or block_size != fmt.block_size:
        raise CorruptEntry(f"layout {layout}/B{block_size}, expected {expected}/B{fmt.block_size}")
    if payload_bytes != num_blocks * fmt.block_bytes or num_blocks == 0:
        raise CorruptEntry(f"{payload_bytes} payload bytes for {num_blocks} blocks")
    hashes_end = HEADER_SIZE + 32 * num_blocks
    if view.nbytes != hashes_end + payload_bytes:
        raise CorruptEntry(f"{view.nbytes} bytes, expected {hashes_end + payload_bytes}")
    hashes, payload = view[HEADER_SIZE:hashes_end], view[hashes_end:]
    if zlib.crc32(payload, zlib.crc32(hashes)) != crc:
        raise CorruptEntry("checksum mismatch")
    block_hashes = [bytes(hashes[i : i + 32]) for i in range(0, len(hashes), 32)]
    if block_hashes[0] != key:
        raise CorruptEntry("entry's first block is not its key")
    return Entry(first_block, block_hashes, payload)
