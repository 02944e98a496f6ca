"""The paged kernels' sliding window (``window=W``): a row of context length n attends to its
keys ``n - W .. n - 1`` only.

Against SDPA over exactly those keys gathered from the blocks, for float32, float16, bfloat16
and int8 pools; rows alone and in batches (decode rows with their own tables, prefill-like
rows sharing one table across the window's edge, long rows whose spans are split between
threads); the same bits for a row whatever the batch; blocks wholly before the window never
read (their table entries may be -1, as a sliding-window group's freed blocks are); window 0
the same bits as none; a negative window refused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import make_kv_cache
from tests.unit.test_kernels import _scattered_tables

if not kernels.available():
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

ops = torch.ops.kvwise
HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16


def _windowed_reference(q, k_cache, v_cache, tables, lens, window):
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        lo = max(0, n - window)
        ids = tables[b, : -(-n // BLOCK)]
        k = k_cache[ids].reshape(-1, KV_HEADS, DIM)[lo:n].float().transpose(0, 1)
        v = v_cache[ids].reshape(-1, KV_HEADS, DIM)[lo:n].float().transpose(0, 1)
        out = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True)
        outs.append(out.squeeze(1))
    return torch.stack(outs)  # (B, H, D)


def _tables(lengths, num_blocks, gen):
    """Scattered blocks per row (test_kernels' tables at this file's block size)."""
    return _scattered_tables(lengths, BLOCK, num_blocks, gen)


def _prefill_rows(start, count, length_of_table, num_blocks, gen):
    """Rows at positions start .. start + count - 1 of one sequence: one shared table."""
    table = _tables([length_of_table], num_blocks, gen)[0]
    lens = torch.arange(start + 1, start + count + 1)
    return table.expand(count, -1).contiguous(), lens


CASES = {
    "one decode": [1],
    "short decodes": [17, 5, 64, 1],
    "long decode": [2100],
    "mixed": [300, 5, 2100, 90, 1],
    "sixteen alike": [90] * 16,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 32, 33, 100, 4096])
@pytest.mark.parametrize("case", sorted(CASES))
def test_float_pools_attend_within_the_window(dtype, window, case):
    lengths = CASES[case]
    gen = torch.Generator().manual_seed(len(lengths) * 31 + window)
    num_blocks = 4 + sum(-(-n // BLOCK) for n in lengths)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    tables = _tables(lengths, num_blocks, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen) * 3
    lens = torch.tensor(lengths)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, DIM**-0.5, window=window)
    want = _windowed_reference(q, k_cache, v_cache, tables, lens, window)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [7, 64, 300])
def test_prefill_rows_across_the_windows_edge_and_alone(window):
    gen = torch.Generator().manual_seed(window)
    num_blocks = 80
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    tables, lens = _prefill_rows(window - 5, 700, 1000, num_blocks, gen)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, DIM**-0.5, window=window)
    want = _windowed_reference(q, k_cache, v_cache, tables, lens, window)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)
    for row in (0, 4, 5, 6, 350, 699):  # each row's bits as when it runs alone
        alone = ops.paged_decode_attention(q[row : row + 1], k_cache, v_cache,
                                           tables[row : row + 1], lens[row : row + 1],
                                           DIM**-0.5, window=window)  # fmt: skip
        assert torch.equal(alone[0], got[row]), row


def test_blocks_before_the_window_are_never_read():
    gen = torch.Generator().manual_seed(3)
    lengths, window = [2100, 700, 33], 100
    num_blocks = 4 + sum(-(-n // BLOCK) for n in lengths)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    tables = _tables(lengths, num_blocks, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen)
    lens = torch.tensor(lengths)
    want = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, DIM**-0.5, window=window)
    freed = tables.clone()
    for b, n in enumerate(lengths):
        freed[b, : max(0, n - window) // BLOCK] = -1  # gone, as a sliding group frees them
    got = ops.paged_decode_attention(q, k_cache, v_cache, freed, lens, DIM**-0.5, window=window)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="block id out of range"):  # and without the window
        ops.paged_decode_attention(q, k_cache, v_cache, freed, lens, DIM**-0.5)


def test_window_zero_is_no_window_and_a_negative_one_is_refused():
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(20, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(20, BLOCK, KV_HEADS, DIM, generator=gen)
    tables = _tables([300], 20, gen)
    q, lens = torch.randn(1, HEADS, DIM, generator=gen), torch.tensor([300])
    plain = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                  window=0), plain)  # fmt: skip
    assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                  window=300), plain)  # fmt: skip
    assert not torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                      window=299), plain)  # fmt: skip
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window=-1)


@pytest.mark.parametrize("window", [1, 40, 512])
@pytest.mark.parametrize("case", ["mixed", "sixteen alike"])
def test_int8_pool_attends_within_the_window(window, case):
    lengths = CASES[case]
    gen = torch.Generator().manual_seed(window + len(lengths))
    num_blocks = 4 + sum(-(-n // BLOCK) for n in lengths)
    cache = make_kv_cache(KVSpec(1, KV_HEADS, DIM, BLOCK, "int8"), num_blocks)
    slots = torch.arange(num_blocks * BLOCK)
    cache.write(0, slots, torch.randn(len(slots), KV_HEADS, DIM, generator=gen),
                torch.randn(len(slots), KV_HEADS, DIM, generator=gen))  # fmt: skip
    all_blocks = torch.arange(num_blocks).unsqueeze(0)
    k_deq, v_deq = (x.view(num_blocks, BLOCK, KV_HEADS, DIM)
                    for x in cache.gather(0, all_blocks))  # fmt: skip
    tables = _tables(lengths, num_blocks, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen) * 3
    lens = torch.tensor(lengths)
    got = ops.paged_decode_attention_int8(q, cache.k_blocks[0], cache.v_blocks[0], tables, lens,
                                          DIM**-0.5, BLOCK, window=window)  # fmt: skip
    want = _windowed_reference(q, k_deq, v_deq, tables, lens, window)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_the_torch_path_masks_as_the_kernels_attend(kv):
    """One step of decodes (contexts past and inside the window) and prefill chunks (one from
    position 0 longer than the window, one continuing a cached prefix) through the backend's
    torch path and through its paged kernel, each layer its own window and scale. (int8: the
    two paths differ beyond this tolerance even on full-attention layers, a difference that
    predates windows; its kernel is checked against its reference above.)"""
    from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
    from kvwise.types import SamplingParams
    from kvwise.worker.attention import LayerAttention
    from kvwise.worker.attention_backend import make_attention
    from kvwise.worker.input_batch import build_input_batch

    spec = KVSpec(2, KV_HEADS, DIM, BLOCK, kv)
    layers = [LayerAttention(40, 0.1), LayerAttention(0, DIM**-0.5)]
    shapes = [(1, 300), (1, 20), (1, 41), (120, 0), (50, 200)]  # (new tokens, start position)
    blocks, scheduled, first = [], [], 0
    for i, (n, start) in enumerate(shapes):
        count = -(-(start + n) // BLOCK)
        blocks.append(list(range(first, first + count)))
        first += count
        scheduled.append(ScheduledRequest(f"r{i}", [0] * n, start, blocks[-1], True,
                                          SamplingParams(), 0))  # fmt: skip
    meta = build_input_batch(SchedulerOutput(scheduled=scheduled), BLOCK).attn_meta
    gen = torch.Generator().manual_seed(11)
    caches = [make_kv_cache(spec, first + 1, torch.float32, use) for use in (True, False)]
    everything = torch.arange((first + 1) * BLOCK)  # earlier contexts: the same K/V in both
    old_k = torch.randn(len(everything), KV_HEADS, DIM, generator=gen)
    old_v = torch.randn(len(everything), KV_HEADS, DIM, generator=gen)
    for cache in caches:
        for layer in range(2):
            cache.write(layer, everything, old_k, old_v)
        cache.begin_step([], meta.slot_mapping)
    rows = meta.slot_mapping.numel()
    q = torch.randn(rows, HEADS, DIM, generator=gen)
    k = torch.randn(rows, KV_HEADS, DIM, generator=gen)
    v = torch.randn(rows, KV_HEADS, DIM, generator=gen)
    kernel = make_attention(caches[0], HEADS, DIM, layers=layers)
    torch_path = make_attention(caches[1], HEADS, DIM, paged_kernel=False, layers=layers)
    assert kernel.paged_kernel and not torch_path.paged_kernel
    for layer in range(2):
        got = torch_path.bind(meta)(layer, q, k, v)
        want = kernel.bind(meta)(layer, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
