"""Quantized weights on their own: GGUF Q4_0 / Q4_1 blocks map exactly onto the int4
kernel's groups, and both kernels match a dequantize-then-matmul reference within the
precision of their bfloat16 inputs and outputs."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvwise.models.quant import Int4Weight, Int8Weight, q4_groups

# what bfloat16 activations and outputs allow: |error| within this fraction of the output's
# largest magnitude (bfloat16 keeps 8 significant bits: 2^-8 = 0.4% per rounding)
TOLERANCE = 0.02


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= TOLERANCE * scale


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_map_exactly_onto_int4_groups(kind):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = quantize(weight, qtype)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(48, 96))
    codes, scales, zeros = q4_groups(raw, kind, (48, 96))
    assert codes.min() >= 0 and codes.max() <= 15
    mine = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    assert torch.equal(mine, reference)  # the mapping itself is exact
    kernel = Int4Weight(codes, scales, zeros, 32)
    # the kernel keeps scale and zero in bfloat16: within that rounding of the exact weight
    assert (kernel.dequantize() - reference).abs().max() <= 2**-7 * reference.abs().max()
    x = torch.randn(5, 96)
    _close(kernel.mm(x), x @ kernel.dequantize().t())


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_int4_and_int8_kernels_match_a_dequantized_reference(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 128)
    # int4: known codes, scales and zeros; the reference uses them as the kernel stores them
    codes = torch.randint(0, 16, (160, 128))
    scales, zeros = torch.rand(160, 4) * 0.01 + 1e-3, torch.randn(160, 4) * 0.01
    int4 = Int4Weight(codes, scales, zeros, 32)
    bf = lambda t: t.to(torch.bfloat16).float().repeat_interleave(32, 1)  # noqa: E731
    weight = (codes.float() - 8) * bf(scales) + bf(zeros)
    out = int4.mm(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    _close(out, x @ weight.t())
    assert torch.allclose(int4.dequantize(), weight, rtol=2**-7, atol=1e-6)  # bf16 output
    # int8: per output channel
    int8 = Int8Weight.quantize(weight)
    reference = x @ (int8.codes.float() * int8.scales.float()[:, None]).t()
    _close(int8.mm(x), reference)
    # and the quantization errors are what 4 and 8 bits give
    int4_error = (Int4Weight.quantize(weight, 32).dequantize() - weight).abs().max()
    int8_error = (int8.dequantize() - weight).abs().max()
    assert int8_error < int4_error < weight.abs().max() / 10


def test_int8_rows_are_the_dequantized_rows():
    weight = torch.randn(50, 32)
    quantized = Int8Weight.quantize(weight)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(quantized.rows(ids), quantized.dequantize()[ids])


def test_mismatched_groups_are_refused():
    with pytest.raises(ValueError, match="group size"):
        Int4Weight(torch.zeros(8, 40, dtype=torch.int32), torch.ones(8, 1), torch.ones(8, 1), 32)
