"""``gguf_pack.fast_pack`` (the C++ ``gguf_pack`` op) against the Python path, bit for bit.

For every GGUF type with a packed layout, random raw blocks (random bytes, float16 fields set
to sane scales) of random widths and row counts (1, and counts that are not multiples of 8)
must give exactly the ``packed`` tensor of the weight the Python path builds: ``Int4Weight``
from ``q4_groups`` (Q4_0 / Q4_1), ``Q8Weight`` from ``q8_groups`` (Q8_0), ``BlockWeight`` from
``gguf_blocks.decode`` + ``pack`` (the rest; its torch fallback, so that the reference shares
no C++ with the op). Also: row-strided and read-only inputs, left as they were; Q4_0 scales at
float16's edges; the types and sizes it refuses; a large weight's buffer (2 MiB-aligned, for
huge pages) holding the same bytes.
"""

from __future__ import annotations

import os
import warnings

import gguf
import numpy as np
import pytest
import torch

from kvwise import kernels
from kvwise.models.gguf_blocks import BlockWeight
from kvwise.models.gguf_load import q8_groups
from kvwise.models.gguf_pack import PACKED_TYPES, fast_pack
from kvwise.models.quant import Int4Weight, Q8Weight, q4_groups

if not kernels.available():
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

# byte offsets of each type's float16 fields within a block (ggml's block structs)
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
    "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82],
}  # fmt: skip


def _sizes(name: str) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


def random_raw(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`(rows, row bytes)` uint8 blocks of type ``name``: random bytes, sane float16 fields."""
    block, size = _sizes(name)
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scales = rng.uniform(-0.02, 0.02, n).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def python_packed(raw: np.ndarray, name: str, shape: tuple[int, int], monkeypatch) -> torch.Tensor:
    """The packed layout the Python path builds (kernels off: torch alone makes the bytes)."""
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "available", lambda: False)
        if name in ("Q4_0", "Q4_1"):
            return Int4Weight(*q4_groups(raw, name, shape)).packed
        if name == "Q8_0":
            return Q8Weight(*q8_groups(raw, shape)).packed
        return BlockWeight.from_gguf(raw, name, shape).packed


def _assert_same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None and got.dtype == torch.uint8 and got.is_contiguous()
    assert got.shape == want.shape
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.parametrize("rows", [1, 5, 8, 13, 40])
@pytest.mark.parametrize("name", PACKED_TYPES)
def test_fast_pack_equals_the_python_path(name, rows, monkeypatch):
    block, _ = _sizes(name)
    rng = np.random.default_rng([rows, PACKED_TYPES.index(name)])
    cols = block * int(rng.integers(1, 4 if block == 256 else 12))
    raw = random_raw(name, rows, cols, rng)
    _assert_same(
        fast_pack(raw, name, (rows, cols)), python_packed(raw, name, (rows, cols), monkeypatch)
    )


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_a_large_weight_on_an_aligned_buffer(name, monkeypatch):
    """Weights of 4 MiB and more are packed into a buffer whose data starts on a 2 MiB boundary
    (``weights.h``: huge pages where THP is "always"), a view of a larger allocation: the
    bytes are the Python path's all the same, and the view behaves as a plain tensor."""
    block, _ = _sizes(name)
    rows, cols = 4104, 4096  # ~4.5-17 MiB packed, and a row count that is not 8's multiple
    raw = random_raw(name, rows, cols, np.random.default_rng(11))
    got = fast_pack(raw, name, (rows, cols))
    assert got is not None and got.nbytes >= 4 << 20
    if os.uname().sysname == "Linux":
        assert got.data_ptr() % (2 << 20) == 0
    _assert_same(got, python_packed(raw, name, (rows, cols), monkeypatch))
    assert torch.equal(got.clone(), got) and got.untyped_storage().nbytes() >= got.nbytes


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_strided_permuted_and_read_only_rows(name, monkeypatch):
    rng = np.random.default_rng(7)
    block, _ = _sizes(name)
    rows, cols = 21, 2 * max(block, 64)
    big = random_raw(name, 2 * rows, cols, rng)
    strided = big[::2]  # rows one apart in memory: read in place
    want = python_packed(np.ascontiguousarray(strided), name, (rows, cols), monkeypatch)
    _assert_same(fast_pack(strided, name, (rows, cols)), want)
    perm = rng.permutation(rows)  # rows in another order (gguf_load un-permutes q / k so)
    want = python_packed(strided[perm], name, (rows, cols), monkeypatch)
    _assert_same(fast_pack(strided[perm], name, (rows, cols)), want)
    backwards = strided[::-1]  # a negative stride: copied once
    want = python_packed(np.ascontiguousarray(backwards), name, (rows, cols), monkeypatch)
    _assert_same(fast_pack(backwards, name, (rows, cols)), want)
    before = big.copy()
    big.setflags(write=False)  # as a read-only memory map is
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast_pack(big[::2], name, (rows, cols))
        fast_pack(big.reshape(-1), name, (2 * rows, cols))  # flat bytes, any dtype viewed
    assert np.array_equal(big, before)


def test_q4_0_minimum_at_float16_edges(monkeypatch):
    """m = float16(-8 d), as the Python path rounds it: signed zeros, subnormals, the largest
    normals (-8 d past 65504 is -inf), infinities."""
    edges = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-6, 6.1e-5, 1e-4, 1.0, -2.5, 4095, 8189, 8190,
                      -8192, 65504, np.inf, -np.inf], np.float16)  # fmt: skip
    rows, cols = 9, 32 * len(edges)
    raw = random_raw("Q4_0", rows, cols, np.random.default_rng(3)).reshape(-1, 18)
    raw[:, 0:2] = np.resize(edges, len(raw)).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(rows, -1)
    _assert_same(
        fast_pack(raw, "Q4_0", (rows, cols)), python_packed(raw, "Q4_0", (rows, cols), monkeypatch)
    )


def test_types_and_sizes_it_refuses(monkeypatch):
    raw = np.zeros((8, 34), np.uint8)
    assert fast_pack(raw, "F32", (8, 8)) is None
    assert fast_pack(raw, "IQ4_NL", (8, 32)) is None
    with pytest.raises(ValueError, match="whole blocks"):
        fast_pack(np.zeros((8, 144), np.uint8), "Q4_K", (8, 128))
    with pytest.raises(ValueError, match="bytes of raw data"):
        fast_pack(np.zeros((8, 33), np.uint8), "Q8_0", (8, 32))
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert fast_pack(raw, "Q8_0", (8, 32)) is None  # the caller takes the Python path
