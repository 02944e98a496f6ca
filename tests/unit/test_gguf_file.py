"""kvwise/models/gguf_file.py against the `gguf` package's own reader, field by field and tensor
by tensor: the default model, small files written with `gguf.GGUFWriter` (every value type,
nested arrays, several tensor types, non-default alignments), string arrays of every shape the
bulk scan must handle, and truncated or corrupt files (a ValueError naming the file, always)."""

from __future__ import annotations

import mmap
import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwise.models import gguf_file
from kvwise.models.gguf_file import GGUFFile, scan_strings

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
# strings the scan must get right: empty (a prefix of 8 zeros), over 255 bytes (not a
# candidate), NUL runs (stray candidates inside a string), multi-byte UTF-8 and emoji
AWKWARD = ["", "a", "\x00" * 9, "x\x00\x00\x00\x00\x00\x00\x00\x00y", "é" * 200, "🦙" * 70,
           "Ġthe", "▁", " ", "\n\t", "b" * 256, "c" * 1000, ""]  # fmt: skip


def assert_same(path: Path) -> GGUFFile:
    """Every field and tensor of ``path`` as gguf.GGUFReader gives it."""
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(ref.fields)
    for key, want in ref.fields.items():
        got = ours.fields[key]
        assert (got.name, got.offset, got.types) == (want.name, want.offset, want.types), key
        value = want.contents()
        assert got.contents() == value and type(got.contents()) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got.contents()] == [type(v) for v in value], key
            if value:
                for index in (0, len(value) - 1, slice(1, 4), slice(None, None, -2)):
                    assert got.contents(index) == want.contents(index), (key, index)
        assert ours.get_field(key) is got
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert len(ours.tensors) == len(ref.tensors)
    for got, want in zip(ours.tensors, ref.tensors):
        assert isinstance(got, gguf.ReaderTensor)
        assert (got.name, got.tensor_type, got.n_elements, got.n_bytes, got.data_offset) == (
            want.name, want.tensor_type, want.n_elements, want.n_bytes, want.data_offset
        )  # fmt: skip
        assert type(got.tensor_type) is QT
        assert got.shape.dtype == want.shape.dtype and got.shape.tolist() == want.shape.tolist()
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, got.name
        assert np.array_equal(got.data.view(np.uint8), want.data.view(np.uint8)), got.name
        assert type(got.data) is np.ndarray and not got.data.flags.writeable
        assert got.field.name == got.name and got.field.contents() is None
    return ours


def write_gguf(path: Path, kv: list[tuple], tensors: list[tuple] = (), alignment: int = 0):
    """A file from ``kv`` ((key, value, type[, sub type])) and ``tensors`` ((name, array[,
    raw type])), written by gguf's own writer."""
    writer = gguf.GGUFWriter(path, "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    for key, value, *types in kv:
        writer.add_key_value(key, value, *types)
    for name, array, *raw_type in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_type[0] if raw_type else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SCALARS = [
    ("t.u8", 255, VT.UINT8), ("t.i8", -128, VT.INT8), ("t.u16", 65535, VT.UINT16),
    ("t.i16", -32768, VT.INT16), ("t.u32", 2**32 - 1, VT.UINT32), ("t.i32", -(2**31), VT.INT32),
    ("t.u64", 2**64 - 1, VT.UINT64), ("t.i64", -(2**63), VT.INT64), ("t.f32", 0.1, VT.FLOAT32),
    ("t.f64", -1e300, VT.FLOAT64), ("t.true", True, VT.BOOL), ("t.false", False, VT.BOOL),
    ("t.str", "héllo 🦙\x00", VT.STRING), ("t.empty", "", VT.STRING),
]  # fmt: skip
ARRAYS = [(f"{key}s", [value] * 3, VT.ARRAY, vtype) for key, value, vtype in SCALARS[:-2]] + [
    ("t.floats", [1.5, -2.25, 3e-8, float("inf")], VT.ARRAY, VT.FLOAT32),
    ("t.bools", [True, False, True], VT.ARRAY, VT.BOOL),
    ("t.strings", AWKWARD, VT.ARRAY, VT.STRING),
    ("t.nested", [[1, 2], [3], [4, 5, 6]], VT.ARRAY, VT.ARRAY),
    ("t.nested_strings", [["a", "bé"], [""], ["🦙" * 300]], VT.ARRAY, VT.ARRAY),
    ("t.deeper", [[[1.5], [2.5, 3.5]], [[4.5]]], VT.ARRAY, VT.ARRAY),
]


def small_tensors() -> list[tuple]:
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((3, 64)).astype(np.float32)
    return [
        ("f32", floats),
        ("f32_3d", rng.standard_normal((2, 3, 5)).astype(np.float32)),
        ("f16", floats.astype(np.float16)),
        ("f64_1d", rng.standard_normal(7)),
        ("i8", rng.integers(-128, 127, (2, 33), dtype=np.int8)),
        ("i32", rng.integers(-9, 9, (5,), dtype=np.int32)),
        ("bf16", gguf.quants.quantize(floats, QT.BF16), QT.BF16),
        ("q8_0", gguf.quants.quantize(floats, QT.Q8_0), QT.Q8_0),
        ("q4_0", gguf.quants.quantize(floats, QT.Q4_0), QT.Q4_0),
        ("q4_k", rng.integers(0, 255, (2, 144 * 2), dtype=np.uint8), QT.Q4_K),
        ("q6_k", rng.integers(0, 255, (1, 210), dtype=np.uint8), QT.Q6_K),
    ]


@pytest.fixture
def small_file(tmp_path) -> Path:
    return write_gguf(tmp_path / "small.gguf", SCALARS + ARRAYS, small_tensors())


def test_default_model_same_as_gguf():
    from kvwise.models.default import default_model_path

    reader = assert_same(default_model_path())
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_every_value_and_tensor_type_same_as_gguf(small_file):
    reader = assert_same(small_file)
    assert reader.fields["t.strings"].contents() == AWKWARD
    assert reader.fields["t.nested"].contents() == [1, 2, 3, 4, 5, 6]  # gguf flattens
    assert reader.fields["t.nested"].types == [VT.ARRAY, VT.ARRAY, VT.INT32]
    assert reader.fields["t.f32"].contents() == float(np.float32(0.1))
    q8 = next(t for t in reader.tensors if t.name == "q8_0")
    assert np.array_equal(gguf.quants.dequantize(q8.data, q8.tensor_type).shape, (3, 64))
    assert reader.tensors[0].shape.tolist() == [64, 3]  # innermost first


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_alignment_same_as_gguf(tmp_path, alignment):
    rng = np.random.default_rng(alignment)
    tensors = [
        (f"t{i}", rng.standard_normal(n).astype(np.float32)) for i, n in enumerate([3, 1, 17])
    ]
    path = write_gguf(tmp_path / "a.gguf", [("t.x", "odd length", VT.STRING)], tensors, alignment)
    reader = assert_same(path)
    assert reader.alignment == alignment
    assert all(t.data_offset % alignment == 0 for t in reader.tensors)


def test_contents_are_fresh_lists(small_file):
    field = GGUFFile(small_file).fields["t.strings"]
    field.contents().append("changed")
    assert field.contents() == AWKWARD
    assert field.contents(2) == AWKWARD[2]


def test_mmap_reachable_for_madvise(small_file):
    reader = GGUFFile(small_file)
    assert isinstance(reader.mmap, mmap.mmap)
    base = reader.data  # gguf_load._release's walk: the first base holding an `_mmap`
    while not isinstance(getattr(base, "_mmap", None), mmap.mmap):
        base = base.base
    assert base._mmap is reader.mmap
    tensor = reader.tensors[0]
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    reader.mmap.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)
    assert np.array_equal(tensor.data, small_tensors()[0][1])  # read back from the file


# ---- the bulk string scan -----------------------------------------------------------------


def _packed(strings: list[bytes]) -> tuple[bytes, list[int]]:
    starts, out = [], bytearray()
    for s in strings:
        starts.append(len(out))
        out += len(s).to_bytes(8, "little") + s
    return bytes(out), starts


def _check_scan(strings: list[str], tail: bytes = b"\x05" + b"\x00" * 7 + b"junk") -> None:
    encoded = [s.encode() for s in strings]
    packed, starts = _packed(encoded)
    buf = b"pad" + packed + tail  # an array inside a file, more candidates after it
    found, lengths, end = scan_strings(buf, 3, len(strings), len(buf))
    assert found.tolist() == [3 + s for s in starts]
    assert lengths.tolist() == [len(s) for s in encoded]
    assert end == 3 + len(packed)
    assert gguf_file.StringArray(buf, found, lengths, "x").decoded() == strings


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(AWKWARD)), max_size=60))
def test_scan_strings_any_list(strings):
    _check_scan(strings)


def test_scan_strings_large_and_past_many_breaks():
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdeéĠ▁🦙") for _ in range(rng.randint(1, 9))) for _ in range(5000)
    ]
    _check_scan(words)  # several windows, no breaks
    broken = list(words)
    for i in range(0, 5000, 100):  # 50 breaks: past _MAX_BREAKS the walk takes over
        broken[i] = rng.choice(["", "\x00" * 8, "z" * 300])
    _check_scan(broken)


def test_large_vocabulary_same_as_gguf(tmp_path):
    rng = random.Random(1)
    vocab = [f"tok{i}" + "é" * rng.randint(0, 3) for i in range(20000)] + AWKWARD
    kv = [("tokenizer.ggml.tokens", vocab, VT.ARRAY, VT.STRING),
          ("tokenizer.ggml.scores", [float(i) for i in range(len(vocab))], VT.ARRAY, VT.FLOAT32),
          ("tokenizer.ggml.merges", [f"t{i} x" for i in range(5000)], VT.ARRAY, VT.STRING)]  # fmt: skip
    assert assert_same(write_gguf(tmp_path / "v.gguf", kv)).fields[kv[0][0]].contents() == vocab


# ---- truncated and corrupt files ----------------------------------------------------------


def _expect_error(path: Path, match: str | None = None) -> None:
    with pytest.raises(ValueError, match=match) as raised:
        reader = GGUFFile(path)
        for field in reader.fields.values():  # string arrays decode on first use
            field.contents()
    assert str(path) in str(raised.value)


def _patched(path: Path, offset: int, new: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(new)] = new
    out = path.with_name(f"patched_{offset}.gguf")
    out.write_bytes(bytes(raw))
    return out


def _value_at(path: Path, key: str) -> int:
    """Offset of the value type of ``key`` (a field's offset is its key's)."""
    return GGUFFile(path).fields[key].offset + 8 + len(key.encode())


def test_every_truncation_is_a_value_error(small_file, tmp_path):
    raw = small_file.read_bytes()
    reader = GGUFFile(small_file)
    edges = [f.offset for f in reader.fields.values()] + [t.field.offset for t in reader.tensors]
    cut_points = set(range(0, 64)) | set(range(64, reader.data_offset + 1, 29))
    cut_points |= {e + d for e in edges for d in (-1, 0, 1, 8, 9, 12, 13)}
    cut_points |= {t.data_offset + t.n_bytes - 1 for t in reader.tensors}
    cut = tmp_path / "cut.gguf"
    for size in sorted(cut_points):
        cut.write_bytes(raw[:size])
        _expect_error(cut)


def test_corrupt_headers(small_file, tmp_path):
    ten = tmp_path / "not.gguf"
    ten.write_bytes(b"GGML" + bytes(100))
    _expect_error(ten, "magic")
    for version, match in ((1, "version 1"), (4, "version 4"), (3 << 24, "big-endian")):
        _expect_error(_patched(small_file, 4, struct.pack("<I", version)), match)
    _expect_error(_patched(small_file, 8, struct.pack("<Q", 2**62)), "tensor count")
    _expect_error(_patched(small_file, 16, struct.pack("<Q", 2**40)), "key/value count")
    _expect_error(_patched(small_file, _value_at(small_file, "t.u8"), b"\x63"), "value type 99")
    strings = _value_at(small_file, "t.strings")
    _expect_error(_patched(small_file, strings + 8, struct.pack("<Q", 2**61)), "string array")
    _expect_error(_patched(small_file, strings + 4, b"\x0d"), "array item type 13")
    # a length of ~2**64 inside a string array: past the file's end, no overflow
    first_length = strings + 16
    _expect_error(_patched(small_file, first_length, b"\xff" * 8), "cut short")


def test_corrupt_contents(small_file, tmp_path):
    reader = GGUFFile(small_file)
    key = _value_at(small_file, "t.str")  # "héllo": é is 0xC3 0xA9
    _expect_error(_patched(small_file, key + 4 + 8 + 1, b"\xff"), "not UTF-8")
    strings = reader.fields["t.strings"]
    where = small_file.read_bytes().index("é".encode() * 200, strings.offset)
    _expect_error(_patched(small_file, where, b"\xe9"), "not UTF-8")  # only at contents()
    same_key = reader.fields["t.i8"].offset + 8  # "t.i8" -> "t.u8": a key twice
    _expect_error(_patched(small_file, same_key, b"t.u8"), "twice")
    first = reader.tensors[0].field.offset  # "f32"
    f16 = next(t for t in reader.tensors if t.name == "f16").field.offset
    _expect_error(_patched(small_file, f16 + 8, b"f32"), "twice")
    after_name = first + 8 + len(b"f32")
    _expect_error(_patched(small_file, after_name, struct.pack("<I", 5)), "dims")
    type_at = after_name + 4 + 2 * 8
    _expect_error(_patched(small_file, type_at, struct.pack("<I", 77)), "unknown ggml type")
    _expect_error(_patched(small_file, type_at + 4, struct.pack("<Q", 2**40)), "past the end")
    _expect_error(_patched(small_file, type_at + 4, struct.pack("<Q", 3)), "aligned")


def test_bad_alignment_and_deep_nesting(tmp_path):
    _expect_error(write_gguf(tmp_path / "a.gguf", [("general.alignment", 48, VT.UINT32)]), "power")
    _expect_error(write_gguf(tmp_path / "b.gguf", [("general.alignment", 32, VT.UINT64)]), "uint32")
    depth = 40  # arrays of arrays of ... one int
    value = b"".join(struct.pack("<IQ", VT.ARRAY, 1) for _ in range(depth)) + struct.pack(
        "<IQi", VT.INT32, 1, 7
    )  # fmt: skip
    key = b"deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", VT.ARRAY) + value
    deep = tmp_path / "deep.gguf"
    deep.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    _expect_error(deep, "nested")


def test_big_endian_refused(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "be.gguf", "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("w", np.ones((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _expect_error(tmp_path / "be.gguf", "big-endian")


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _expect_error(empty)


def test_random_corruption_only_value_errors(small_file, tmp_path):
    raw = small_file.read_bytes()
    header_end = GGUFFile(small_file).data_offset
    rng = random.Random(27)
    bad = tmp_path / "bad.gguf"
    for _ in range(300):
        corrupt = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(header_end)] = rng.randrange(256)
        bad.write_bytes(bytes(corrupt))
        try:
            reader = GGUFFile(bad)
            for field in reader.fields.values():
                field.contents()
        except ValueError as e:
            assert str(bad) in str(e)
