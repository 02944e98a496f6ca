"""Quantized weights on their own: GGUF Q4_0 / Q4_1 blocks map exactly onto int4 blocks, and
both kernels match a dequantize-then-matmul reference within the precision of their inputs
(int8 activations for int4, bfloat16 for int8)."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvwise.models.quant import Int4Weight, Int8Weight, Q8Weight, q4_groups, quantize_activations

# what the kernels' activations allow: |error| within this fraction of the output's largest
# magnitude (bfloat16 keeps 8 significant bits: 2^-8 = 0.4% per rounding; int8 activations per
# block of 32: 1/254 of a block's largest value per element)
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
    codes, scales, mins = q4_groups(raw, kind, (48, 96))
    assert codes.min() >= 0 and codes.max() <= 15
    mine = codes.float() * scales.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)
    assert torch.equal(mine, reference)  # the mapping itself is exact
    kernel = Int4Weight(codes, scales, mins)
    # the kernel keeps d and m in float16, as the file does: the weight is exact
    assert torch.equal(kernel.dequantize(), reference)
    x = torch.randn(5, 96)
    _close(kernel.mm(x), x @ kernel.dequantize().t())


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_int4_and_int8_kernels_match_a_dequantized_reference(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 128)
    # int4: known codes, scales and mins; the reference uses them as the kernel stores them
    codes = torch.randint(0, 16, (164, 128))  # 164: not a multiple of 8 output columns
    scales, mins = torch.rand(164, 4) * 0.01 + 1e-3, torch.randn(164, 4) * 0.01
    int4 = Int4Weight(codes, scales, mins)
    f16 = lambda t: t.half().float().repeat_interleave(32, 1)  # noqa: E731
    weight = codes.float() * f16(scales) + f16(mins)
    out = int4.mm(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 164)
    _close(out, x @ weight.t())
    assert torch.equal(int4.dequantize(), weight)
    # int8: per output channel
    int8 = Int8Weight.quantize(weight)
    reference = x @ (int8.codes.float() * int8.scales.float()[:, None]).t()
    _close(int8.mm(x), reference)
    # and the quantization errors are what 4 and 8 bits give
    int4_error = (Int4Weight.quantize(weight).dequantize() - weight).abs().max()
    int8_error = (int8.dequantize() - weight).abs().max()
    assert int8_error < int4_error < weight.abs().max() / 10


def test_q8_0_blocks_come_back_exactly_and_their_rows_are_exact():
    """The embedding / LM head: a Q8_0 tensor dequantized (as the GGUF loader yields it) and
    quantized again gives the file's blocks back, its rows are exact, and q8mm is the
    int8-activation product of those weights."""
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((50, 96)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType.Q8_0
    reference = torch.from_numpy(dequantize(quantize(weight, qtype), qtype).reshape(50, 96))
    quantized = Q8Weight.quantize(reference)
    assert torch.equal(quantized.dequantize(), reference)
    ids = torch.tensor([[3, 0], [49, 3]])
    assert torch.equal(quantized.rows(ids), reference[ids])
    x = torch.randn(6, 96)
    out = quantized.mm(x)
    assert out.shape == (6, 50)
    want = quantize_activations(x).double() @ reference.double().t()
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()
    # a few exact logits per row: float32 dots with the exact rows
    top = torch.tensor([[0, 49, 7], [3, 3, 1], [2, 8, 16], [9, 10, 11], [1, 2, 3], [48, 47, 46]])
    exact = (x.double()[:, None, :] * reference.double()[top]).sum(-1)
    assert torch.allclose(quantized.dot_rows(x, top).double(), exact, rtol=1e-5, atol=1e-5)


def test_int4_without_the_kernels_computes_the_same_product(monkeypatch):
    """The plain-torch fallback (no compiler, or KVWISE_KERNELS=0) rounds the activations as
    the kernel does: the two agree to float32 rounding."""
    from kvwise import kernels

    torch.manual_seed(0)
    weight = Int4Weight.quantize(torch.randn(48, 96))
    x = torch.randn(7, 96)
    fast = weight.mm(x)
    monkeypatch.setattr(kernels, "available", lambda: False)
    slow = weight.mm(x)
    assert (fast - slow).abs().max() <= 1e-5 * fast.abs().max()


def test_mismatched_blocks_are_refused():
    with pytest.raises(ValueError, match="blocks of 32"):
        Int4Weight(torch.zeros(8, 40, dtype=torch.int32), torch.ones(8, 1), torch.ones(8, 1))
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Weight.quantize(torch.zeros(8, 40))


def test_int8_weights_of_an_odd_width_are_refused_by_name():
    """torch's int8 kernel crashes the process on an input width that is not a multiple of 16
    (with two rows or more): such a weight is refused when it is made, with a clear error."""
    with pytest.raises(ValueError, match="multiple of 16, got a 64x24 weight"):
        Int8Weight.quantize(torch.randn(64, 24))
    assert Int8Weight.quantize(torch.randn(64, 48)).mm(torch.randn(4, 48)).shape == (4, 64)
