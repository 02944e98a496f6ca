"""kvwise's kernels for GGUF's block types (kernels/csrc/kquant.cpp, models/gguf_blocks.py).

Each type's weights must be the file's own, exactly (``gguf.quants.dequantize`` is the
reference), the matmul the exact block sums of those weights with the activations as kvwise
quantizes them (float64 reference, within float32 rounding), the same bits on every
instruction path and whatever else is in the batch; and the loader must never run a tensor
below its file's precision.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kvwise import kernels
from kvwise.models.gguf_blocks import SPECS, BlockWeight, _code_planes, decode, pack
from kvwise.models.gguf_types import bits_per_weight, runs_as
from kvwise.models.quant import quantize_activations
from tests.gguf_blocks_util import F16_FIELDS, random_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kvwise kernels did not build")
TYPES = sorted(SPECS)


def _paths() -> list[str]:
    best = torch.ops.kvwise.qk_path()
    order = ["scalar", "avx2", "avx512vnni"]
    return order[: order.index(best) + 1]


@pytest.fixture
def restore_path():
    best = torch.ops.kvwise.qk_path()
    yield
    torch.ops.kvwise.qk_path(best)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 44, 48])  # a partial group, an odd group count, pairs
def test_weights_are_the_files_own(name, rows):
    raw = random_blocks(name, rows, 512, np.random.default_rng(rows))
    expected = dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, 512)
    weight = BlockWeight.from_gguf(raw, name, (rows, 512))
    assert np.array_equal(weight.dequantize().numpy(), expected)
    ids = torch.tensor([[0, rows - 1], [rows // 2, 0]])
    assert torch.equal(weight.rows(ids), torch.from_numpy(expected[ids.numpy()]))


@pytest.mark.parametrize("name", TYPES)
def test_matmul_is_exact_block_sums_on_every_path(name, restore_path):
    rng = np.random.default_rng(7)
    rows, cols = 40, 768
    raw = random_blocks(name, rows, cols, rng)
    weight = BlockWeight.from_gguf(raw, name, (rows, cols))
    dense = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, cols))
    x = torch.from_numpy(rng.standard_normal((11, cols)).astype(np.float32))
    want = quantize_activations(x).double() @ dense.double().t()
    outs = {}
    for path in _paths():
        torch.ops.kvwise.qk_path(path)
        outs[path] = weight.mm(x)
    for path, out in outs.items():  # the same bits on every path
        assert torch.equal(out, outs["scalar"]), path
    error = (outs["scalar"].double() - want).abs().max() / want.abs().max()
    assert error < 1e-5  # float32 rounding of exact integer sums (measured ~2e-7)


@pytest.mark.parametrize("name", TYPES)
def test_the_largest_codes_and_activations_sum_exactly(name, restore_path):
    """Every code at its largest (all bits set) against activations all at +-127 (a constant
    row): the vector paths' narrow partial sums (int16 within a block, for codes of at most 5
    bits) must not wrap."""
    raw = np.full((16, 512 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]
                   // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]), 0xFF,
                  dtype=np.uint8)  # fmt: skip
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1])
    for at in F16_FIELDS.get(name, ()):
        blocks[:, at : at + 2] = (
            np.full(len(blocks), 1e-3, np.float16).view(np.uint8).reshape(-1, 2)
        )
    if name == "MXFP4":  # code 15 is -12, the largest magnitude; scale 2^-10
        blocks[:, 0] = 118
    weight = BlockWeight.from_gguf(raw, name, (16, 512))
    dense = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(16, 512))
    x = torch.ones(4, 512)
    x[1] = -1
    x[2, ::2] = -1  # alternating signs
    want = quantize_activations(x).double() @ dense.double().t()
    for path in _paths():
        torch.ops.kvwise.qk_path(path)
        got = weight.mm(x).double()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, path


@pytest.mark.parametrize("name", TYPES)
def test_each_row_independent_of_the_batch(name):
    rng = np.random.default_rng(3)
    raw = random_blocks(name, 24, 512, rng)
    weight = BlockWeight.from_gguf(raw, name, (24, 512))
    x = torch.from_numpy(rng.standard_normal((13, 512)).astype(np.float32))
    batched = weight.mm(x)
    for i in (0, 5, 12):
        assert torch.equal(weight.mm(x[i : i + 1]), batched[i : i + 1])
        assert torch.equal(weight.mm(x[i : i + 9]), batched[i : i + 9])


@pytest.mark.parametrize("name", TYPES)
def test_packer_matches_the_torch_layout(name):
    raw = random_blocks(name, 20, 256 * 2, np.random.default_rng(5))
    decoded = decode(raw, name, (20, 512))
    spec = SPECS[name]
    packed = pack(spec, decoded)  # the kernels' qk_pack
    blocks = packed[..., spec.header_bytes :].reshape(packed.shape[0], -1, spec.block_bytes)
    planes = _code_planes(spec, torch.from_numpy(decoded.codes))
    assert torch.equal(blocks[..., : planes.shape[-1]], planes)


def test_no_type_runs_below_its_files_precision():
    """Every GGML type a weight can have: run exactly, or converted to a format with at least
    as many bits a weight (Q8_0's 8.5 or float32)."""
    formats = {"float32": 32.0, "Q8_0": 8.5}
    for qtype in gguf.GGML_QUANT_SIZES:
        name = qtype.name
        if name in ("F64", "I8", "I16", "I32", "I64"):  # refused, never run lower
            with pytest.raises(ValueError, match=name):
                runs_as(name)
            continue
        for head in (False, True):
            how = runs_as(name, head)
            fmt, _, kind = how.partition(" ")
            if kind == "(exact)":
                assert fmt in ("float32", "int4", name), how
                continue
            assert kind == "(converted)", how
            assert formats[fmt] >= bits_per_weight(name), (name, how)


@pytest.mark.parametrize("name", TYPES)
def test_dot_rows_are_float32_dots_of_the_exact_rows(name):
    rng = np.random.default_rng(11)
    raw = random_blocks(name, 30, 512, rng)
    weight = BlockWeight.from_gguf(raw, name, (30, 512))
    dense = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(30, 512))
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    ids = torch.tensor([[0, 29, 7, 7], [1, 2, 3, 4], [28, 0, 15, 16]])
    want = torch.einsum("nkh,nh->nk", dense[ids].double(), x.double())
    got = weight.dot_rows(x, ids)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_mxfp4_scales_are_exact_at_every_exponent(restore_path):
    """MXFP4's scale byte e is 2^(e - 128) for every e, the subnormal ones (e = 0, 1) and the
    largest (e = 255: 2^127, as ggml reads it) included; the matmul of a block is its exact
    sum within float32 rounding, on every path, at scales far from 1 each way."""
    rng = np.random.default_rng(11)
    raw = random_blocks("MXFP4", 8, 256 * 32, rng)  # 256 blocks a row: every e once
    blocks = raw.reshape(-1, 17)
    blocks[:, 0] = np.tile(np.arange(256, dtype=np.uint8), 8)
    blocks[blocks[:, 0] >= 250, 1:] &= 0x11  # codes 0 and +-1 there: no infinities
    weight = BlockWeight.from_gguf(raw, "MXFP4", (8, 8192))
    dense = dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(8, 8192)
    assert np.isfinite(dense).all()
    assert np.array_equal(weight.dequantize().numpy(), dense)
    assert torch.equal(weight.rows(torch.arange(8)), torch.from_numpy(dense))
    for e in (40, 100, 128, 180):
        x = torch.zeros(3, 8192)
        x[:, 32 * e : 32 * e + 32] = torch.linspace(-1, 1, 32) * torch.tensor([[1.0], [0.3], [7.0]])
        want = quantize_activations(x).double() @ torch.from_numpy(dense).double().t()
        for path in _paths():
            torch.ops.kvwise.qk_path(path)
            got = weight.mm(x).double()
            assert ((got - want).abs() <= 1e-6 * want.abs()).all(), (e, path)
