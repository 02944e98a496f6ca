"""int4 KV at the worker (kv_cache.py, attention.py) on synthetic K/V: a block's keys are
quantized per channel once it is full, whichever steps its rows came in; until then they wait
in full precision; every query sees earlier blocks' sealed keys and its own block's keys
exactly as written, whether its sequence was prefilled whole, in chunks or decoded."""

from __future__ import annotations

import pytest
import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
from kvwise.types import SamplingParams
from kvwise.worker import kv_quant
from kvwise.worker.attention_backend import make_attention
from kvwise.worker.input_batch import build_input_batch
from kvwise.worker.kv_cache import make_kv_cache

BS, KV_HEADS, HEADS, DIM, T = 4, 2, 4, 8, 11
SPEC = KVSpec(1, KV_HEADS, DIM, BS, "int4", group_size=4)
TABLE = [5, 2, 7]  # the sequence's blocks, deliberately out of order


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HEADS, DIM, generator=g)
    k = torch.randn(T, KV_HEADS, DIM, generator=g)
    k[..., 3] += 20  # an outlier channel: per-channel scales absorb it
    v = torch.randn(T, KV_HEADS, DIM, generator=g)
    return q, k, v


def _feed(attention, q, k, v, steps, table, released=()) -> torch.Tensor:
    """Feed rows [start, end) of one sequence (blocks ``table``) step by step through one
    layer's attention; return its outputs ``(T, H * D)``."""
    cache = attention.kv_cache
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    for start, end in steps:
        sched = SchedulerOutput(scheduled=[ScheduledRequest(
            "r", list(range(start, end)), start, table, True, SamplingParams(), 0)])  # fmt: skip
        meta = build_input_batch(sched, cache.block_size).attn_meta
        cache.begin_step(list(released), meta.slot_mapping)  # as the model runner calls it
        out[start:end] = attention.forward(0, q[start:end], k[start:end], v[start:end], meta)
    return out


def _run(steps: list[tuple[int, int]], released=()):
    """The test sequence fed step by step; attention outputs (T, H*D) and the cache."""
    cache = make_kv_cache(SPEC, 8)
    return _feed(make_attention(cache, HEADS, DIM), *_data(), steps, TABLE, released), cache


def _reference() -> torch.Tensor:
    """Each query: sealed (quantized per channel) keys of earlier blocks, its own block's keys
    as written; values quantized per token."""
    q, k, v = _data()
    full = T // BS * BS
    sealed = kv_quant.dequantize_int4_keys(*kv_quant.quantize_int4_keys(
        k[:full].reshape(-1, BS, KV_HEADS, DIM))).reshape(full, KV_HEADS, DIM)  # fmt: skip
    values = kv_quant.dequantize_int4(*kv_quant.quantize_int4(v, 4), 4)
    out = torch.empty(T, HEADS * DIM)
    for p in range(T):
        own = p // BS * BS
        keys = torch.cat([sealed[:own], k[own : p + 1]]).repeat_interleave(2, dim=1)
        vals = values[: p + 1].repeat_interleave(2, dim=1)  # (p + 1, HEADS, DIM)
        scores = torch.einsum("hd,thd->ht", q[p], keys) * DIM**-0.5
        out[p] = torch.einsum("ht,thd->hd", scores.softmax(-1), vals).reshape(-1)
    return out


def test_whole_chunked_and_decoded_see_the_same_keys():
    expected = _reference()
    whole, whole_cache = _run([(0, T)])
    chunked, chunked_cache = _run([(0, 3), (3, 5), (5, 6), (6, 10), (10, 11)])
    decoded, decoded_cache = _run([(0, 2)] + [(i, i + 1) for i in range(2, T)])
    for out in (whole, chunked, decoded):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the sealed blocks hold the same bytes whichever way their rows came in
    for cache in (chunked_cache, decoded_cache):
        assert torch.equal(cache.raw[:, :, TABLE[:2]], whole_cache.raw[:, :, TABLE[:2]])
    # and their keys are quantized per channel: the outlier channel has its own scale
    scales = whole_cache.scales[0][0][TABLE[0]].float()  # (kv_heads, head_dim, 2)
    assert (scales[:, 3, 1] > 15).all() and (scales[:, :3, 1].abs() < 5).all()


def test_staging_slots_are_taken_sealed_and_released():
    _, cache = _run([(0, 3), (3, 5)])
    assert cache.staging.open_blocks == {TABLE[0], TABLE[1]}  # block 0 sealed this step, 1 open
    cache.begin_step()
    assert cache.staging.open_blocks == {TABLE[1]}  # the sealed block's slot freed a step later
    cache.begin_step([TABLE[1]])  # the core freed the open block
    assert cache.staging.open_blocks == set()
    assert cache.staging.num_free == cache.staging.num_slots == cache.staged.shape[1]


def test_staging_grows_past_its_first_slots():
    cache = make_kv_cache(SPEC, 64)
    k = torch.randn(20, KV_HEADS, DIM)
    slots = torch.tensor([b * BS for b in range(20)])  # the first row of 20 blocks
    cache.begin_step(slot_mapping=slots)
    cache.write(0, slots, k, k)
    assert len(cache.staging.open_blocks) == 20
    assert cache.staged.shape[1] == cache.staging.num_slots >= 20
    assert torch.equal(cache.open_keys(0, 19, 1)[0], k[19])


def test_the_kernels_write_and_attend_as_the_torch_path():
    """The C++ int4 write gives the torch path's bytes; its decode attention the same outputs
    to float32 rounding."""
    from kvwise import kernels

    if not kernels.available():
        pytest.skip("kvwise kernels not built")
    steps = [(0, 5)] + [(i, i + 1) for i in range(5, T)]
    out, cache = _run(steps)
    torch_cache = make_kv_cache(SPEC, 8, use_kernels=False)
    attention = make_attention(torch_cache, HEADS, DIM)
    assert cache.rows_attention is not None and not attention.paged_kernel  # kernels vs none
    torch_out = _feed(attention, *_data(), steps, TABLE)
    assert torch.equal(cache.raw[:, :, TABLE], torch_cache.raw[:, :, TABLE])
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
    # wide-range values: the float16 scale and minimum round alike in both
    x = torch.randn(6, KV_HEADS, DIM) * torch.logspace(-3, 4, 6).view(6, 1, 1)
    a, b = make_kv_cache(SPEC, 8), make_kv_cache(SPEC, 8, use_kernels=False)
    slots = torch.tensor([0, 4, 8, 12, 16, 20])  # first rows of six blocks
    for cache in (a, b):
        cache.begin_step(slot_mapping=slots)
        cache.write(0, slots, x, x)
    assert torch.equal(a.raw[0, 1], b.raw[0, 1])


@pytest.mark.parametrize(("block_size", "kv_heads", "heads", "group"),
                         [(32, 3, 9, 32), (16, 2, 4, 16), (32, 1, 4, 64), (8, 2, 10, 8)])  # fmt: skip
def test_the_decode_kernel_at_real_shapes(block_size, kv_heads, heads, group):
    """The vectorized paths (blocks of 8k tokens, groups of 16/32/64, up to 4 query heads a KV
    head) and the plain one (5 query heads a KV head) against the torch path."""
    from kvwise import kernels

    if not kernels.available():
        pytest.skip("kvwise kernels not built")
    dim, n = 64, 3 * block_size + 5
    spec = KVSpec(1, kv_heads, dim, block_size, "int4", group_size=group)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(n, kv_heads, dim, generator=g) + torch.linspace(-4, 4, dim)
    v = torch.randn(n, kv_heads, dim, generator=g)
    table = [9, 3, 0, 6]
    steps = [(0, block_size + 3)] + [(i, i + 1) for i in range(block_size + 3, n)]
    outs = [
        _feed(make_attention(make_kv_cache(spec, 12), heads, dim, paged_kernel=paged),
              q, k, v, steps, table)
        for paged in (True, False)
    ]  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
