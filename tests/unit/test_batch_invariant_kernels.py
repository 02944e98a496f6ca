"""The kernels a step runs give each row the same bits whatever else is in the call: the paged
attention kernels (every KV format; a row alone, among rows of other lengths, at any thread
count) and the float32 matmul (any number of rows). What makes greedy decoding
batch-invariant end to end (tests/model/test_batch_invariance.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import PagedKVCache, make_kv_cache

if not kernels.available():
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

ops = torch.ops.kvwise
HEADS, KV_HEADS, DIM = 9, 3, 64  # the default model's attention
# one row of each length: under a span, a span and one, many spans, a block's edge
LENGTHS = [33, 1, 700, 90, 17, 2000, 64, 5, 32]


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def _pool(dtype: str, block_size: int, gen: torch.Generator) -> PagedKVCache:
    """A one-layer pool holding random K/V in every slot."""
    num_blocks = 2 + sum(-(-n // block_size) for n in LENGTHS)
    spec = KVSpec(1, KV_HEADS, DIM, block_size, dtype)
    cache = make_kv_cache(spec, num_blocks, torch.float32)
    k = torch.randn(num_blocks * block_size, KV_HEADS, DIM, generator=gen) * 2
    v = torch.randn(num_blocks * block_size, KV_HEADS, DIM, generator=gen)
    slots = torch.arange(num_blocks * block_size)
    if spec.sealed_keys:  # int4: every block written whole, so sealed
        for first in range(0, len(slots), block_size):
            block = slots[first : first + block_size]
            cache.begin_step(slot_mapping=block)
            cache.write(0, block, k[first : first + block_size], v[first : first + block_size])
    else:
        cache.write(0, slots, k, v)
    return cache


def _tables(block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Each row's scattered blocks ``(rows, max_blocks)``, zero-padded."""
    num_blocks = 2 + sum(-(-n // block_size) for n in LENGTHS)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(LENGTHS), -(-max(LENGTHS) // block_size), dtype=torch.long)
    used = 0
    for row, n in enumerate(LENGTHS):
        count = -(-n // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    return tables


def _attend(cache: PagedKVCache, q, tables, lens):
    block_size = cache.block_size
    kc, vc = cache.k_blocks[0], cache.v_blocks[0]
    if cache.spec.dtype == "int8":
        return ops.paged_decode_attention_int8(q, kc, vc, tables, lens, DIM**-0.5, block_size)
    if cache.spec.dtype == "int4":
        # every block sealed: the own block's keys from a staging slot of the dequantized keys
        keys, _ = cache.gather(0, tables)  # (rows, L, KV_HEADS, DIM)
        own = (lens - 1) // block_size
        staged = torch.stack([keys[r].view(-1, block_size, KV_HEADS, DIM)[own[r]]
                              for r in range(len(lens))]).contiguous()  # fmt: skip
        return ops.paged_decode_attention_int4(q, kc, vc, staged, tables, lens,
                                               torch.arange(len(lens)), DIM**-0.5, block_size,
                                               32)  # fmt: skip
    return ops.paged_decode_attention(q, kc, vc, tables, lens, DIM**-0.5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_paged_attention_gives_a_row_the_same_bits_alone_and_in_any_batch(dtype, threads):
    gen = torch.Generator().manual_seed(3)
    block_size = 32 if dtype == "int4" else 16
    cache = _pool(dtype, block_size, gen)
    tables = _tables(block_size, gen)
    lens = torch.tensor(LENGTHS)
    q = torch.randn(len(LENGTHS), HEADS, DIM, generator=gen) * 3  # peaked softmaxes too
    full = _attend(cache, q, tables, lens)
    # the same maths as SDPA over the keys and values the pool holds
    keys, values = cache.gather(0, tables)
    for row, n in enumerate(LENGTHS):
        want = F.scaled_dot_product_attention(
            q[row].unsqueeze(1), keys[row, :n].transpose(0, 1), values[row, :n].transpose(0, 1),
            enable_gqa=True,
        ).squeeze(1)  # fmt: skip
        torch.testing.assert_close(full[row], want, atol=3e-5, rtol=1e-4)
    for num_threads in (1, 2, 3):
        torch.set_num_threads(num_threads)
        assert torch.equal(_attend(cache, q, tables, lens), full), num_threads
        for row, n in enumerate(LENGTHS):
            width = -(-n // block_size)
            one = _attend(
                cache, q[row : row + 1], tables[row : row + 1, :width], lens[row : row + 1]
            )
            assert torch.equal(one[0], full[row]), (num_threads, row)
        # rows in another order, the long ones next to short ones
        order = torch.tensor([5, 1, 2, 8, 0])
        mixed = _attend(cache, q[order], tables[order], lens[order])
        assert torch.equal(mixed, full[order]), num_threads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize(("start", "count"), [(0, 70), (500, 37), (31, 2), (1000, 300)])
def test_a_prefill_chunks_rows_get_the_bits_each_would_get_alone(dtype, start, count, threads):
    """A prefill chunk's rows share a block table (the kernels compute them in groups, a K/V row
    loaded once for several queries): each row's output is still the one it gets alone, as the
    decode of that token, at any thread count."""
    gen = torch.Generator().manual_seed(start + count)
    block_size = 32 if dtype == "int4" else 16
    cache = _pool(dtype, block_size, gen)
    num_blocks = -(-(start + count) // block_size)
    table = torch.randperm(cache.num_blocks, generator=gen)[:num_blocks].unsqueeze(0)
    tables = table.expand(count, num_blocks).contiguous()
    lens = torch.arange(start + 1, start + count + 1)
    q = torch.randn(count, HEADS, DIM, generator=gen) * 3
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        rows = _attend(cache, q, tables, lens)
        for i in range(count):
            alone = _attend(cache, q[i : i + 1], tables[i : i + 1], lens[i : i + 1])
            assert torch.equal(alone[0], rows[i]), (num_threads, i)


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 49152), (37, 13)])
def test_f32mm_is_row_invariant_and_as_close_as_torch_mm(shape, threads):
    """The float path's matmul: every output one fma chain down k (a row's bits the same at any
    row count, thread count and tile), within float32 rounding of the exact product."""
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(k, n, generator=gen)
    x = torch.randn(70, k, generator=gen)
    full = ops.f32mm(x, w)
    exact = x.double() @ w.double()
    scale = exact.abs().max().item()
    assert (full.double() - exact).abs().max().item() <= 4e-6 * scale
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 31, 32, 33, 70):
            for start in (0, 1) if rows < 70 else (0,):
                got = ops.f32mm(x[start : start + rows], w)
                assert torch.equal(got, full[start : start + rows]), (num_threads, rows, start)
    assert torch.equal(ops.f32mm(x[:, ::1].t().contiguous().t(), w), full)  # strided x


@pytest.mark.parametrize("dtype", ["int4", "int8", "bfloat16"])
def test_sequence_attention_is_the_engines_step_for_a_cold_prompt(dtype):
    """What ``kvwise eval`` calls to measure a KV format the pool stores: the bits the engine's
    attention gives a prompt prefilled in one chunk (built through the scheduler's types, over
    blocks out of order), and for int4 within float32 rounding of the torch reference over the
    same sealed keys."""
    from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
    from kvwise.types import SamplingParams
    from kvwise.worker.attention import LayerAttention, attend_open_blocks
    from kvwise.worker.attention_backend import make_attention
    from kvwise.worker.input_batch import build_input_batch
    from kvwise.worker.kv_quant import round_trip
    from kvwise.worker.one_sequence import sequence_attention

    gen = torch.Generator().manual_seed(7)
    n, block_size = 77, 32
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen) + torch.linspace(-3, 3, DIM)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    spec = KVSpec(1, KV_HEADS, DIM, block_size, dtype)
    got = sequence_attention(spec, HEADS, n)(0, q, k, v)
    cache = make_kv_cache(spec, 5, torch.float32)
    sched = SchedulerOutput(scheduled=[ScheduledRequest(
        "r", list(range(n)), 0, [4, 0, 2], True, SamplingParams(), 0)])  # fmt: skip
    meta = build_input_batch(sched, block_size).attn_meta
    cache.begin_step([], meta.slot_mapping)
    assert torch.equal(got, make_attention(cache, HEADS, DIM).forward(0, q, k, v, meta))
    if dtype == "int4":
        stored_k = round_trip(k, "int4", keys=True, key_block=block_size)
        qp = q.transpose(0, 1).contiguous().unsqueeze(0)
        want = attend_open_blocks(qp, stored_k, round_trip(v, "int4"), k, 0, block_size,
                                  LayerAttention(0, DIM**-0.5))  # fmt: skip
        torch.testing.assert_close(got, want.reshape(n, -1), rtol=1e-5, atol=1e-5)
