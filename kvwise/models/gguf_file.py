"""A GGUF reader of our own: metadata parsed in milliseconds, tensor data memory-mapped.

`GGUFFile(path)` reads a little-endian GGUF v2 or v3 file: the header, every key/value field
(all value types, nested arrays included), the tensor infos and the alignment
(``general.alignment``, default 32); the file is mapped read-only (`np.memmap`) and each
tensor's data is a view of the mapping, never a copy.

It is a drop-in for `gguf.GGUFReader` as kvwise uses it (it subclasses it, so `isinstance`
checks and type hints hold; the base class's parser is never run):

- ``fields``: ``{key: GGUFField}`` in file order, after gguf's three pseudo-fields
  ``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``; ``get_field(key)``.
  ``GGUFField.contents(index_or_slice=slice(None))`` returns what gguf's does: a str, int,
  float or bool for a scalar; for an array a list (an element for an int index), a nested
  array flattened to its leaves. ``GGUFField.types`` is gguf's: ``[type]`` for a scalar,
  ``[ARRAY, ..., leaf type]`` for an array (the inner types those of its first element).
  ``name`` and ``offset`` (of the key in the file) as gguf; gguf's raw ``parts`` / ``data``
  index lists are not kept.
- ``tensors``: a list of `gguf.ReaderTensor` in file order: ``name``; ``tensor_type`` a
  `gguf.GGMLQuantizationType`; ``shape`` the GGUF dims, innermost first (uint64);
  ``n_elements``; ``n_bytes``; ``data_offset`` absolute in the file; ``data`` a read-only numpy
  view with gguf's dtype and shape (F16/F32/F64/I8..I64 natively, numpy's dim order; every
  other type, BF16 included, uint8 of shape ``(rows..., bytes per row)``).
- ``data``: the whole file as a plain uint8 ndarray whose ``.base`` is the `np.memmap`;
  ``mmap``: the `mmap.mmap` itself (for madvise); ``alignment``; ``data_offset`` (where the
  tensor data starts); ``path``.

Speed: a string array (a vocabulary, its merges) is walked in bulk: the positions of its length
prefixes found with numpy over the raw bytes and checked as a chain (a plain `struct` walk
where that check breaks: an empty or long string), and decoded only when ``contents()`` is
first called, in one UTF-8 decode of the whole array; numeric arrays are one `np.frombuffer`.

Errors: a file that is not GGUF, big-endian, of another version, cut short or inconsistent
(a count past the end of the file, an unknown value or tensor type, a tensor outside the file,
a duplicate key or tensor name, a bad alignment) raises ValueError naming the file; no input
makes it loop or allocate more than the file's size allows.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import quant_shape_to_byte_shape

GGUFValueType = gguf.GGUFValueType
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
_MAX_NESTING = 16  # arrays of arrays this deep and no deeper
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# value type -> (struct format of one scalar, numpy dtype of an array of them)
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    int(t): (struct.Struct(fmt), np.dtype(dtype))
    for t, fmt, dtype in [
        (GGUFValueType.UINT8, "<B", "<u1"),
        (GGUFValueType.INT8, "<b", "<i1"),
        (GGUFValueType.UINT16, "<H", "<u2"),
        (GGUFValueType.INT16, "<h", "<i2"),
        (GGUFValueType.UINT32, "<I", "<u4"),
        (GGUFValueType.INT32, "<i", "<i4"),
        (GGUFValueType.FLOAT32, "<f", "<f4"),
        (GGUFValueType.BOOL, "<?", "?"),
        (GGUFValueType.UINT64, "<Q", "<u8"),
        (GGUFValueType.INT64, "<q", "<i8"),
        (GGUFValueType.FLOAT64, "<d", "<f8"),
    ]
}
# tensor types gguf gives in their own dtype; every other one comes as raw bytes (uint8)
_NATIVE = {
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GGUFField:
    """One key/value field (or a tensor's info, with no types): see the module docstring."""

    __slots__ = ("offset", "name", "types", "_value")

    def __init__(self, offset: int, name: str, types: list[GGUFValueType], value: Any) -> None:
        self.offset, self.name, self.types, self._value = offset, name, types, value

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value, as `gguf.ReaderField.contents` gives it (a fresh list for arrays)."""
        if not self.types:
            return None
        value = self._value
        if self.types[0] != GGUFValueType.ARRAY:
            return value
        if isinstance(value, StringArray):
            value = value.decoded()
        if isinstance(value, np.ndarray):
            return value[index_or_slice].tolist()
        return value[index_or_slice]  # list slicing copies: callers may keep and change it

    def __repr__(self) -> str:
        return f"GGUFField({self.name!r}, types={[t.name for t in self.types]})"


class GGUFFile(gguf.GGUFReader):
    """A GGUF file opened for reading (see the module docstring).

    Raises:
        ValueError: (naming the file) not a little-endian GGUF v2/v3, or corrupt.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path) -> None:  # gguf's own parser is never called
        self.path = Path(path)
        try:
            mapped = np.memmap(self.path, mode="r")
        except ValueError as e:  # numpy's message for an empty file
            raise ValueError(f"GGUF file {self.path}: cannot map it ({e})") from None
        self.mmap = mapped._mmap  # the mmap.mmap (gguf_load madvises tensors' pages away)
        self.data = np.asarray(mapped)  # a plain view: no memmap subclass on every slice
        self.byte_order = "I"
        self.endianess = gguf.GGUFEndian.LITTLE
        parser = _Parser(self.mmap, len(self.data), self.path)
        try:
            self.fields = parser.header_and_fields()
            infos = parser.tensor_infos()
            self.alignment = _alignment(self.fields, self.path)
            self.data_offset = -(-parser.pos // self.alignment) * self.alignment
            self.tensors = [self._tensor(info) for info in infos]
        except struct.error:
            raise ValueError(f"GGUF file {self.path}: cut short (a read past its end)") from None

    def _tensor(self, info: tuple) -> gguf.ReaderTensor:
        offset, name, dims, raw_type, rel_offset = info
        where = f"GGUF file {self.path}: tensor {name!r}"
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{where} has unknown ggml type {raw_type}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if dims and dims[0] % block_size:
            raise ValueError(f"{where}: {dims[0]} elements a row, not whole {block_size}-blocks")
        if rel_offset % self.alignment:
            raise ValueError(f"{where}: offset {rel_offset} not {self.alignment}-aligned")
        n_elements = math.prod(dims)
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + rel_offset
        if start + n_bytes > len(self.data):
            raise ValueError(f"{where}: its {n_bytes} bytes at {start} run past the end")
        np_dims = tuple(reversed(dims))  # numpy order: outermost first
        dtype = _NATIVE.get(ggml_type, np.uint8)
        if dtype is np.uint8:  # (rows..., bytes a row); a 0-dim tensor: its bytes
            np_dims = quant_shape_to_byte_shape(np_dims, ggml_type) if np_dims else (n_bytes,)
        data = self.data[start : start + n_bytes].view(dtype).reshape(np_dims)
        return gguf.ReaderTensor(
            name=name,
            tensor_type=ggml_type,
            shape=np.array(dims, dtype=np.uint64),
            n_elements=n_elements,
            n_bytes=n_bytes,
            data_offset=start,
            data=data,
            field=GGUFField(offset, name, [], None),
        )


def _alignment(fields: dict[str, GGUFField], path: Path) -> int:
    field = fields.get("general.alignment")
    if field is None:
        return gguf.GGUF_DEFAULT_ALIGNMENT
    if field.types != [GGUFValueType.UINT32]:
        raise ValueError(f"GGUF file {path}: general.alignment is not a uint32")
    alignment = field.contents()
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError(f"GGUF file {path}: alignment {alignment} is not a power of two")
    return alignment


class _Parser:
    """A cursor over the mapped bytes. `struct.error` means a read past the end (the caller
    turns it into a ValueError); every count is checked against the bytes left before use."""

    def __init__(self, buf, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, message: str) -> ValueError:
        return ValueError(f"GGUF file {self.path}: {message} (at byte {self.pos})")

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def count(self, min_bytes_each: int, what: str) -> int:
        """A u64 count of items of at least ``min_bytes_each`` bytes that must fit the file."""
        n = self.u64()
        if n * min_bytes_each > self.size - self.pos:
            raise self.fail(f"{what}: {n} items cannot fit in the {self.size} bytes of the file")
        return n

    def string(self) -> str:
        n = self.count(1, "string")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string is not UTF-8") from None

    def header_and_fields(self) -> dict[str, GGUFField]:
        if self.buf[:4] != _MAGIC:
            raise self.fail("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.u32()
        if version not in _VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if version & 0xFFFF == 0 and swapped in _VERSIONS:
                raise self.fail("a big-endian GGUF; only little-endian files are read")
            raise self.fail(f"GGUF version {version}; only versions 2 and 3 are read")
        u32, u64 = GGUFValueType.UINT32, GGUFValueType.UINT64
        self.num_tensors = self.count(8 + 4 + 4 + 8, "tensor count")
        num_kv = self.count(8 + 4 + 1, "key/value count")
        fields = {
            "GGUF.version": GGUFField(4, "GGUF.version", [u32], version),
            "GGUF.tensor_count": GGUFField(8, "GGUF.tensor_count", [u64], self.num_tensors),
            "GGUF.kv_count": GGUFField(16, "GGUF.kv_count", [u64], num_kv),
        }
        for _ in range(num_kv):
            offset = self.pos
            key = self.string()
            if key in fields:
                raise self.fail(f"key {key!r} appears twice")
            types, value = self.value(self.u32(), 0)
            fields[key] = GGUFField(offset, key, types, value)
        return fields

    def value(self, value_type: int, depth: int) -> tuple[list[GGUFValueType], Any]:
        """(gguf's types list, the value) of one value of ``value_type`` at the cursor."""
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            (value,) = scalar[0].unpack_from(self.buf, self.pos)
            self.pos += scalar[0].size
            return [GGUFValueType(value_type)], value
        if value_type == GGUFValueType.STRING:
            return [GGUFValueType.STRING], self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array(depth + 1)
        raise self.fail(f"unknown value type {value_type}")

    def array(self, depth: int) -> tuple[list[GGUFValueType], Any]:
        if depth > _MAX_NESTING:
            raise self.fail(f"arrays nested deeper than {_MAX_NESTING}")
        item_type = self.u32()
        types = [GGUFValueType.ARRAY]
        scalar = _SCALARS.get(item_type)
        if scalar is not None:
            n = self.count(scalar[1].itemsize, "array")
            items = np.frombuffer(self.buf, scalar[1], count=n, offset=self.pos).copy()
            self.pos += n * scalar[1].itemsize
            return types + [GGUFValueType(item_type)], items
        if item_type == GGUFValueType.STRING:
            n = self.count(8, "string array")
            starts, lengths, self.pos = scan_strings(self.buf, self.pos, n, self.size)
            strings = StringArray(self.buf, starts, lengths, f"GGUF file {self.path}")
            return types + [GGUFValueType.STRING], strings
        if item_type != GGUFValueType.ARRAY:
            raise self.fail(f"unknown array item type {item_type}")
        n = self.count(4 + 8, "array of arrays")
        leaves: list = []  # gguf flattens nested arrays to their leaves
        for i in range(n):
            inner_types, inner = self.array(depth + 1)
            if i == 0:
                types += inner_types
            leaves += GGUFField(0, "", inner_types, inner).contents()
        return types, leaves

    def tensor_infos(self) -> list[tuple[int, str, tuple[int, ...], int, int]]:
        """(offset, name, dims innermost first, ggml type, offset in the data) of each tensor."""
        infos, names = [], set()
        for _ in range(self.num_tensors):
            offset = self.pos
            name = self.string()
            if name in names:
                raise self.fail(f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = self.u32()
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {n_dims} dims (at most {_MAX_DIMS})")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
            self.pos += 8 * n_dims
            raw_type = self.u32()
            infos.append((offset, name, dims, raw_type, self.u64()))
        return infos


# ---- string arrays in bulk -------------------------------------------------------------------
#
#   pos                                                                 end
#   | len0 (u64) | bytes0 ... | len1 (u64) | bytes1 ... | ... | lenN-1 | bytesN-1 |
#
# Each prefix's position depends on every string before it, so the walk is a chain. Most
# strings are 1..255 bytes long: a u64 in 1..255 is a low byte and seven zeros, which string
# bytes (UTF-8, no NUL runs) almost never hold. So: every position in a window whose u64 is in
# 1..255 is a candidate, and the candidates are the prefixes as long as each one is where the
# one before it says the next starts. Past the first link that breaks (an empty or long string,
# or a stray candidate), one string is walked with struct and the scan resumes.

_MAX_BREAKS = 16  # chain breaks before the rest is walked string by string


def scan_strings(buf, pos: int, count: int, limit: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(prefix positions, byte lengths, the end) of ``count`` length-prefixed strings at ``pos``.

    Raises:
        struct.error: a string runs past ``limit`` (the file's end).
    """
    starts, lengths, breaks = [], [], 0
    while count:
        chain = _chain(buf, pos, count, limit) if breaks < _MAX_BREAKS else None
        if chain is None:
            found, ends = _walk(buf, pos, count, limit)
        elif not len(chain[0]):  # the string at pos is not a candidate: empty or long
            found, ends = _walk(buf, pos, 1, limit)
            breaks += 1
        else:
            found, ends, broke = chain
            breaks += broke
        starts.append(found)
        lengths.append(ends - found - 8)
        pos, count = int(ends[-1]), count - len(found)
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), pos
    return np.concatenate(starts), np.concatenate(lengths), pos


def _chain(buf, pos: int, count: int, limit: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """The longest run of prefixes from ``pos`` the candidates of one window prove: (positions,
    ends, whether a link broke before the window or ``count`` ran out); None when the window
    is too small to hold a prefix."""
    window = min(limit - pos, 16 * count + 4096)  # 8 bytes of text a string to start with
    if window < 8:
        return None
    is_prefix = np.zeros(window, np.bool_)
    for phase in range(8):  # the u64 at every position, as 8 views of stride 8
        words = np.frombuffer(buf, "<u8", count=(window - phase) // 8, offset=pos + phase)
        is_prefix[phase::8][: len(words)] = (words - 1) < 255  # 1..255 (0 wraps around)
    found = np.flatnonzero(is_prefix)[: count + 1]
    lows = np.frombuffer(buf, np.uint8, count=window, offset=pos)
    ends = found + 8 + lows[found]
    linked = found[1:] == ends[:-1]
    broke = not linked.all()
    n = int(np.argmin(linked)) + 1 if broke else len(found)
    if not len(found) or found[0] != 0:
        n = 0
    n = min(n, count)
    if n and ends[n - 1] + pos > limit:
        raise struct.error("a string runs past the end of the file")
    return found[:n] + pos, ends[:n] + pos, broke


def _walk(buf, pos: int, count: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, ends) of ``count`` strings from ``pos``, one `struct` read each."""
    unpack = _U64.unpack_from
    starts: list[int] = []  # grown, not preallocated: a corrupt count costs no memory
    for _ in range(count):
        starts.append(pos)
        pos += 8 + unpack(buf, pos)[0]
        if pos > limit:  # checked each time: a corrupt length may be near 2**64
            raise struct.error("a string runs past the end of the file")
    found = np.array(starts, np.int64)
    return found, np.append(found[1:], pos)


class StringArray:
    """A string array's prefix positions, decoded to a list of str on first use (cached)."""

    __slots__ = ("_buf", "_starts", "_lengths", "_where", "_decoded")

    def __init__(self, buf, starts: np.ndarray, lengths: np.ndarray, where: str) -> None:
        self._buf, self._starts, self._lengths = buf, starts, lengths
        self._where, self._decoded = where, None

    def __len__(self) -> int:
        return len(self._starts) if self._decoded is None else len(self._decoded)

    def decoded(self) -> list[str]:
        """The strings.

        Raises:
            ValueError: (naming the file) one is not UTF-8.
        """
        if self._decoded is None:
            try:
                self._decoded = _decode(self._buf, self._starts, self._lengths)
            except UnicodeDecodeError:
                raise ValueError(f"{self._where}: a string array holds bytes not UTF-8") from None
            self._buf = self._starts = self._lengths = None
        return self._decoded


def _decode(buf, starts: np.ndarray, lengths: np.ndarray) -> list[str]:
    """All strings at once: the prefixes overwritten with spaces, the whole run decoded in one
    call, then cut at character offsets (a byte offset less the UTF-8 continuation bytes before
    it). NOTE: the spaces around each string keep a bad one from decoding by joining its
    neighbours, so the one decode fails exactly when one string alone would."""
    if not len(starts):
        return []
    first, end = int(starts[0]), int(starts[-1] + 8 + lengths[-1])
    raw = np.frombuffer(buf, np.uint8, count=end - first, offset=first).copy()
    offsets = starts - first
    for k in range(8):
        raw[offsets + k] = 0x20
    text = str(memoryview(raw), "utf-8")
    counter = np.int32 if len(raw) < 2**31 else np.int64
    continuations = np.cumsum((raw & 0xC0) == 0x80, dtype=counter)  # up to and at each byte
    body_starts = offsets + 8  # >= 8: the byte before each is a prefix byte, counted as 0
    body_ends = body_starts + lengths
    char_starts = body_starts - continuations[body_starts - 1]
    char_ends = body_ends - continuations[body_ends - 1]
    return [text[a:b] for a, b in zip(char_starts.tolist(), char_ends.tolist())]
