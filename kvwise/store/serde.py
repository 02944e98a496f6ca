"""KV entries <-> bytes: a fixed versioned header in the clear, then the sealed block hashes
and payload, then the authentication tag.

One entry holds one *layer group* of ``num_blocks`` consecutive blocks of one sequence,
starting at block index ``first_block`` of that sequence: a C-contiguous array
``(group_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` of ``dtype``. Splitting
a chunk by layer groups lets a load stream in layer order: the model runs its first layers
while later groups are still being read.

An entry's key is derived from the chain hash of its *last* block and its group
(``EntryFormat.entry_key``: an HMAC under the store secret). A chain hash covers every token
before it, so the key names the whole prefix the entry ends: two sequences that share only
the entry's first blocks have different keys and never overwrite each other's entries. The
tenant and salt in the chain are in every key, and nobody without the secret can compute the
key of a given prompt. The entry lists the chain hashes of its blocks (checked on load).

Sealing: the block hashes and the payload are encrypted and authenticated with AES-256-GCM
under a key derived from the store secret, with a fresh random 96-bit nonce per entry and the
header as associated data. So an entry cannot be read without the secret (neither its KV nor
its block hashes), and one that was forged, altered, truncated or moved to another key fails
its tag. Without a secret (a shared Redis explicitly allowed without one) the key is derived
from the empty secret: everyone can compute it, so the tag then only detects corruption.

Layout (little-endian)::

    magic "KVWS" | version u16 | fixed header size u16 | key 32s | model digest 16s
    | dtype 8s | layers u16 | kv heads u16 | head dim u16 | block size u32 | first block u32
    | num blocks u32 | layer group u16 | layer groups u16 | payload bytes u64 | nonce 12s
    | sealed(num_blocks x 32-byte block hashes | payload) | tag 16s

Opening an entry checks every header field against what this engine expects and the tag, so
an entry from another model, KV layout, dtype or format version, a truncated file, a flipped
bit or a forgery is a ``CorruptEntry`` (served as a miss), never wrong KV.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvwise.core.kv_spec import KVSpec

MAGIC = b"KVWS"
VERSION = 3
_HEADER = struct.Struct("<4sHH32s16s8sHHHIIIHHQ12s")
HEADER_SIZE = _HEADER.size
TAG_SIZE = 16  # the AES-GCM tag, after the sealed part


class CorruptEntry(ValueError):
    """An entry that must not be loaded; the message says why."""


@dataclass(frozen=True)
class EntryFormat:
    """What this engine's entries look like (its KV layout, model and layer groups); entries
    that differ are rejected."""

    spec: KVSpec
    model_fingerprint: str
    layer_groups: int = 1  # entries per chunk, each a run of consecutive layers
    # the store secret: entry keys are HMACs under it, so nobody without it can compute
    # (probe for, or plant) the key of a given prompt's entry; b"": plain hashes
    secret: bytes = field(default=b"", repr=False)

    def entry_key(self, last_block_hash: bytes, group: int) -> bytes:
        """The key of one layer group of the entry whose last block has this chain hash."""
        if not self.secret:
            return entry_key(last_block_hash, group)
        message = b"kvwise.entry.v4" + last_block_hash + group.to_bytes(2, "little")
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    @functools.cached_property
    def seal_key(self) -> bytes:
        """The AES-256-GCM key entries are sealed with (derived from the store secret)."""
        return hmac.new(self.secret, b"kvwise.seal.v1", hashlib.sha256).digest()

    def __post_init__(self) -> None:
        if not 1 <= self.layer_groups <= self.num_layers:
            raise ValueError(
                f"layer_groups: must be in [1, {self.num_layers}], got {self.layer_groups}"
            )

    def group_layers(self, group: int) -> tuple[int, int]:
        """(first layer, number of layers) of a layer group; the groups tile the layers."""
        base, extra = divmod(self.num_layers, self.layer_groups)
        first = group * base + min(group, extra)
        return first, base + (group < extra)

    def group_of_layer(self, layer: int) -> int:
        for group in range(self.layer_groups):
            first, count = self.group_layers(group)
            if layer < first + count:
                return group
        raise ValueError(f"layer: {layer} out of range")

    @property
    def model_digest(self) -> bytes:
        return hashlib.sha256(self.model_fingerprint.encode()).digest()[:16]

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V, every layer)."""
        return self.spec.block_bytes

    def group_block_bytes(self, group: int) -> int:
        """Payload bytes of one block in one layer group."""
        return self.group_layers(group)[1] * self.spec.layer_block_bytes

    def head_bytes(self, num_blocks: int) -> int:
        """Bytes before the payload: the fixed header and the (sealed) block hashes."""
        return HEADER_SIZE + 32 * num_blocks

    def entry_bytes(self, group: int, num_blocks: int) -> int:
        """Bytes of a whole entry of ``num_blocks`` blocks of a layer group."""
        return self.head_bytes(num_blocks) + num_blocks * self.group_block_bytes(group) + TAG_SIZE


def entry_key(last_block_hash: bytes, group: int) -> bytes:
    """The key of one layer group of the entry whose last block has this chain hash (no
    secret: anyone can compute it)."""
    return hashlib.sha256(
        b"kvwise.entry.v4" + last_block_hash + group.to_bytes(2, "little")
    ).digest()


@dataclass(frozen=True)
class Entry:
    first_block: int
    group: int
    block_hashes: list[bytes]
    # (group_layers, 2, num_blocks, block_size, kv_heads, head_dim); None: opened into the
    # caller's buffers
    payload: memoryview | None

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def pack(
    fmt: EntryFormat, block_hashes: list[bytes], first_block: int, group: int, payload
) -> bytearray:
    """One layer group of a run of blocks as a sealed entry, for
    ``fmt.entry_key(block_hashes[-1], group)``: a buffer of its own, handed to the tier as it
    is (no copy into ``bytes``: the writer's copies hold the GIL the step loop needs).

    ``payload``: a C-contiguous buffer ``(group_layers, 2, num_blocks, block_size, ...)``.
    """
    view = memoryview(payload).cast("B")
    num_blocks = len(block_hashes)
    if not num_blocks or any(len(h) != 32 for h in block_hashes):
        raise ValueError("block_hashes: expected one or more 32-byte hashes")
    if not 0 <= group < fmt.layer_groups:
        raise ValueError(f"group: must be in [0, {fmt.layer_groups}), got {group}")
    if view.nbytes != num_blocks * fmt.group_block_bytes(group):
        raise ValueError(
            f"payload: {view.nbytes} bytes for {num_blocks} blocks of layer group {group}"
        )
    nonce = os.urandom(12)
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        fmt.entry_key(block_hashes[-1], group),
        fmt.model_digest,
        fmt.spec.dtype_tag.encode(),
        fmt.spec.num_layers,
        fmt.spec.num_kv_heads,
        fmt.spec.head_dim,
        fmt.spec.block_size,
        first_block,
        num_blocks,
        group,
        fmt.layer_groups,
        view.nbytes,
        nonce,
    )
    head_end = fmt.head_bytes(num_blocks)
    out = bytearray(head_end + view.nbytes + TAG_SIZE)
    out[:HEADER_SIZE] = header
    sealer = Cipher(algorithms.AES(fmt.seal_key), modes.GCM(nonce)).encryptor()
    sealer.authenticate_additional_data(header)
    with memoryview(out) as dst:
        sealer.update_into(b"".join(block_hashes), dst[HEADER_SIZE:head_end])
        sealer.update_into(view, dst[head_end : head_end + view.nbytes])
    sealer.finalize()
    out[-TAG_SIZE:] = sealer.tag
    return out


def unpack(fmt: EntryFormat, key: bytes, value: bytes | bytearray | memoryview) -> Entry:
    """Open an entry read back under ``key``: check it and decrypt it into a fresh buffer
    (``value`` is left as it is).

    Raises:
        CorruptEntry: anything does not match, or the tag fails (the reason is in the message).
    """
    view = memoryview(value).cast("B")
    num_blocks = _num_blocks(view)
    head_end = fmt.head_bytes(num_blocks)
    out = bytearray(max(view.nbytes - HEADER_SIZE - TAG_SIZE, 0))
    payload = memoryview(out)[head_end - HEADER_SIZE :]
    entry = open_into(fmt, key, value, [memoryview(out)[: head_end - HEADER_SIZE], payload])
    return Entry(entry.first_block, entry.group, entry.block_hashes, payload)


def open_into(fmt: EntryFormat, key: bytes, value, buffers: Sequence) -> Entry:
    """Open an entry held in memory (``value``) straight into ``buffers``: the first takes
    the block hashes (``32 * num_blocks`` bytes), the rest, consecutive, the payload (e.g.
    views of device blocks). ``value`` is left as it is. Returns the entry without payload.

    Raises:
        CorruptEntry: anything does not match, or the tag fails.
    """
    view = memoryview(value).cast("B")
    num_blocks = _num_blocks(view)
    sizes = [memoryview(b).nbytes for b in buffers]
    sealed_end = HEADER_SIZE + sum(sizes)
    if view.nbytes != sealed_end + TAG_SIZE or not sizes or sizes[0] != 32 * num_blocks:
        raise CorruptEntry(f"{view.nbytes} bytes for an entry of {num_blocks} blocks")
    sources, offset = [], HEADER_SIZE
    for size in sizes:
        sources.append(view[offset : offset + size])
        offset += size
    return _open(fmt, key, view[:HEADER_SIZE], sources, list(buffers), view[sealed_end:])


def open_parts(fmt: EntryFormat, key: bytes, parts: Sequence) -> Entry:
    """Open an entry read in pieces, in place: ``parts[0]`` is the header and the sealed
    block hashes, ``parts[1:-1]`` the sealed payload as consecutive buffers (e.g. read straight
    into the device pool), ``parts[-1]`` the tag. Each part is decrypted where it lies.
    Returns the entry without payload.

    Raises:
        CorruptEntry: anything does not match, or the tag fails.
    """
    views = [memoryview(p).cast("B") for p in parts]
    if len(views) < 2 or views[-1].nbytes != TAG_SIZE:
        raise CorruptEntry("entry read without its tag")
    head = views[0]
    num_blocks = _num_blocks(head)
    if head.nbytes != fmt.head_bytes(num_blocks):
        raise CorruptEntry(f"{head.nbytes} header bytes for {num_blocks} blocks")
    sealed = [head[HEADER_SIZE:], *views[1:-1]]
    return _open(fmt, key, head[:HEADER_SIZE], sealed, None, views[-1])


def entry_blocks_from_size(fmt: EntryFormat, group: int, num_bytes: int) -> int | None:
    """How many blocks an entry of ``num_bytes`` holds (None: no whole number of blocks)."""
    per_block = 32 + fmt.group_block_bytes(group)
    num_blocks, rest = divmod(num_bytes - HEADER_SIZE - TAG_SIZE, per_block)
    return num_blocks if num_blocks > 0 and rest == 0 else None


def _num_blocks(view: memoryview) -> int:
    if view.nbytes < HEADER_SIZE:
        raise CorruptEntry(f"truncated header ({view.nbytes} bytes)")
    return _HEADER.unpack_from(view)[11]


class _Header(NamedTuple):
    magic: bytes
    version: int
    header_size: int
    key: bytes
    digest: bytes
    dtype: bytes
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    first_block: int
    num_blocks: int
    group: int
    layer_groups: int
    payload_bytes: int
    nonce: bytes


def _check_header(fmt: EntryFormat, key: bytes, head: memoryview) -> _Header:
    """The fixed header, checked against this engine's format and the key it was read under."""
    if head.nbytes < HEADER_SIZE:
        raise CorruptEntry(f"truncated header ({head.nbytes} bytes)")
    h = _Header._make(_HEADER.unpack_from(head))
    if h.magic != MAGIC:
        raise CorruptEntry("bad magic")
    if h.version != VERSION or h.header_size != HEADER_SIZE:
        raise CorruptEntry(f"format version {h.version}, expected {VERSION}")
    if h.key != key:
        raise CorruptEntry("entry stored under another key")
    if h.digest != fmt.model_digest:
        raise CorruptEntry("entry from another model or KV layout")
    dtype = h.dtype.rstrip(b"\0").decode(errors="replace")
    layout = (dtype, h.num_layers, h.num_kv_heads, h.head_dim, h.block_size)
    spec = fmt.spec
    expected = (spec.dtype_tag, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size)
    if layout != expected:
        raise CorruptEntry(f"layout {layout}, expected {expected}")
    if h.layer_groups != fmt.layer_groups or h.group >= h.layer_groups:
        raise CorruptEntry(
            f"layer group {h.group} of {h.layer_groups}, expected of {fmt.layer_groups}"
        )
    if h.payload_bytes != h.num_blocks * fmt.group_block_bytes(h.group) or h.num_blocks == 0:
        raise CorruptEntry(f"{h.payload_bytes} payload bytes for {h.num_blocks} blocks")
    return h


def _open(fmt: EntryFormat, key: bytes, header, sources: list, dests: list | None, tag) -> Entry:
    """Check the header, decrypt ``sources`` (block hashes, then payload) into ``dests``
    (same sizes, no overlap; None: in place, into ``sources`` themselves) and verify the tag."""
    h = _check_header(fmt, key, header)
    num_sealed = sum(memoryview(s).nbytes for s in sources)
    if num_sealed != 32 * h.num_blocks + h.payload_bytes:
        raise CorruptEntry(
            f"{num_sealed} sealed bytes, expected {32 * h.num_blocks + h.payload_bytes}"
        )
    try:
        opener = Cipher(algorithms.AES(fmt.seal_key), modes.GCM(h.nonce, bytes(tag))).decryptor()
        opener.authenticate_additional_data(bytes(header))
        if dests is None:
            scratch = _scratch()
            for buf in sources:
                _decrypt_in_place(opener, memoryview(buf).cast("B"), scratch)
            dests = sources
        else:
            for src, dst in zip(sources, dests):
                opener.update_into(src, dst)
        opener.finalize()
    except InvalidTag:
        raise CorruptEntry(
            "authentication failed (forged, altered or sealed under another secret)"
        ) from None
    hashes = memoryview(dests[0])
    block_hashes = [bytes(hashes[i : i + 32]) for i in range(0, hashes.nbytes, 32)]
    if fmt.entry_key(block_hashes[-1], h.group) != key:
        raise CorruptEntry("entry's last block and group do not make its key")
    return Entry(h.first_block, h.group, block_hashes, None)


# NOTE: a cipher context never decrypts into the buffer it reads (cryptography >= 51 refuses
# overlapping buffers, and older releases never promised it): an entry read in place is
# decrypted a slice at a time into this scratch buffer and copied back. The slice stays in the
# core's L2 cache, so the copy back costs a fraction of the decryption itself (BENCHMARKS).
_SCRATCH_BYTES = 256 << 10
_scratch_local = threading.local()


def _scratch() -> memoryview:
    """This thread's scratch buffer (the reader opens entries on several threads at once)."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None:
        buf = _scratch_local.buf = memoryview(bytearray(_SCRATCH_BYTES))
    return buf


def _decrypt_in_place(opener, buf: memoryview, scratch: memoryview) -> None:
    """Decrypt ``buf`` where it lies, through ``scratch``, slice by slice (GCM is a stream
    mode: each slice's plaintext has its length, and the tag covers the whole)."""
    for start in range(0, buf.nbytes, scratch.nbytes):
        piece = buf[start : start + scratch.nbytes]
        out = scratch[: piece.nbytes]
        opener.update_into(piece, out)
        piece[:] = out
