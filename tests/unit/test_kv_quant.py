"""Round trips of the quantized KV formats (worker/kv_quant.py): each element comes back within
half a quantization step (plus the float16 rounding of int4's scale and minimum), codes use
their whole range, and zero rows stay zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvwise.worker import kv_quant

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
rows = arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 3), st.just(64)),
              elements=finite)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(rows)
def test_int8_round_trip_is_within_half_a_step(x):
    x = torch.from_numpy(x)
    codes, scales = kv_quant.quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == x.shape[:-1]
    back = kv_quant.dequantize_int8(codes, scales)
    step = scales.unsqueeze(-1)
    assert ((back - x).abs() <= 0.5 * step * (1 + 1e-5) + 1e-30).all()
    amax = x.abs().amax(-1)
    assert (codes.abs().amax(-1)[amax > 0] == 127).all()  # the largest element uses the range
    assert (back[amax == 0] == 0).all()


@settings(max_examples=200, deadline=None)
@given(rows, st.sampled_from([8, 16, 32, 64]))
def test_int4_round_trip_is_within_half_a_step(x, group):
    x = torch.from_numpy(x)
    packed, scale_min = kv_quant.quantize_int4(x, group)
    assert packed.shape == (*x.shape[:-1], 32) and scale_min.dtype == torch.float16
    back = kv_quant.dequantize_int4(packed, scale_min, group)
    g = x.reshape(*x.shape[:-1], 64 // group, group)
    span = (g.amax(-1) - g.amin(-1)).unsqueeze(-1)
    mag = g.abs().amax(-1, keepdim=True)
    # half a step, plus float16 rounding of min and scale (relative 2^-11 each, the scale's
    # error times up to 15 codes)
    bound = span / 30 + mag * 2.0**-11 + 16 * (span / 15) * 2.0**-11 + 1e-6
    err = (back - x).reshape(g.shape).abs()
    assert (err <= bound).all()


@pytest.mark.parametrize("group", [16, 32])
def test_int4_packs_two_channels_a_byte_low_nibble_first(group):
    x = torch.zeros(1, 1, 64)
    x[..., 0::2] = 15.0  # every group spans 0..15 with scale 1 and minimum 0
    packed, scale_min = kv_quant.quantize_int4(x, group)
    assert (packed == 0x0F).all()
    assert (scale_min[..., 0] == 1).all() and (scale_min[..., 1] == 0).all()


def test_int4_on_smooth_data_is_accurate():
    """Not only bounded: on Gaussian rows (KV-like) the mean error is a small fraction."""
    x = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(0))
    back = kv_quant.dequantize_int4(*kv_quant.quantize_int4(x, 32), 32)
    assert (back - x).abs().mean() < 0.1 * x.abs().mean()
    back8 = kv_quant.dequantize_int8(*kv_quant.quantize_int8(x))
    assert (back8 - x).abs().mean() < 0.01 * x.abs().mean()


def test_round_trip_per_format():
    x = torch.randn(40, 3, 64, generator=torch.Generator().manual_seed(2))
    x[..., 5] *= 30  # an outlier key channel
    assert kv_quant.round_trip(x, "float32") is x
    assert torch.equal(kv_quant.round_trip(x, "bfloat16"), x.bfloat16().float())
    errs = {d: (kv_quant.round_trip(x[:32], d, keys=True) - x[:32]).abs().mean().item()
            for d in ("float16", "int8", "int4-pt", "int4")}  # fmt: skip
    assert errs["float16"] < errs["int8"] < errs["int4"]
    # per-channel keys absorb the outlier channel: far less error than per-token groups
    assert errs["int4"] < errs["int4-pt"] / 2
    kc = kv_quant.round_trip(x, "int4", keys=True)  # one 32-token block, then 8 open rows
    assert torch.equal(kc[32:], x[32:])  # the partial last block stays full precision
    kc16 = kv_quant.round_trip(x, "int4", keys=True, key_block=16)
    assert torch.equal(kc16[32:], x[32:]) and not torch.equal(kc16[:32], kc[:32])
    values = kv_quant.round_trip(x, "int4")  # values: per token, whatever the block
    assert torch.equal(values, kv_quant.round_trip(x, "int4-pt", keys=True))
    with pytest.raises(ValueError, match="kv_key_block"):
        kv_quant.round_trip(x, "int4", keys=True, key_block=3)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.round_trip(x, "int3")


@settings(max_examples=100, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([2, 16, 32]),
                                    st.integers(1, 3), st.just(8)), elements=finite))  # fmt: skip
def test_int4_keys_round_trip_per_channel_within_half_a_step(x):
    """Keys are grouped per block, head and channel (over the block's tokens)."""
    x = torch.from_numpy(x)  # (blocks, block_size, heads, D)
    codes, scale_min = kv_quant.quantize_int4_keys(x)
    n, bs, heads, dim = x.shape
    assert codes.shape == (n, heads, dim, bs // 2) and scale_min.shape == (n, heads, dim, 2)
    back = kv_quant.dequantize_int4_keys(codes, scale_min)
    assert back.shape == x.shape
    span = x.amax(1, keepdim=True) - x.amin(1, keepdim=True)  # per channel over the block
    mag = x.abs().amax(1, keepdim=True)
    bound = span / 30 + mag * 2.0**-11 + 16 * (span / 15) * 2.0**-11 + 1e-6
    assert ((back - x).abs() <= bound).all()


def test_int4_keys_pack_two_tokens_a_byte():
    x = torch.zeros(1, 4, 1, 2)
    x[:, 0::2] = 15.0  # tokens 0 and 2 at the top of the range, 1 and 3 at the bottom
    codes, scale_min = kv_quant.quantize_int4_keys(x)
    assert (codes == 0x0F).all() and (scale_min[..., 0] == 1).all()
