"""The paged kernels' score soft cap (``softcap=c``): every score, after the scale, becomes
``c * tanh(score / c)`` before the softmax (Gemma 2's attn_logit_softcapping).

Against an explicit float64 reference (scores, cap, softmax, values) over the keys each row
sees, for float32, float16, bfloat16 and int8 pools, with and without a sliding window, for the
group kernels (head_dim 64) and the per-head path (head_dim 40); rows alone and batched
bit-identical (decode rows with their own tables, prefill-like rows sharing one, a long row
whose spans are split between threads); the cap can fail the check (a small cap moves the
output); softcap 0 the same bits as none, a negative one refused; the backend's torch path
(explicit scores where a layer is capped) as the kernel attends.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import make_kv_cache

if not kernels.available():
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

ops = torch.ops.kvwise
HEADS, KV_HEADS, BLOCK = 8, 2, 16
CASES = {
    "short decodes": [17, 5, 64, 1],
    "mixed": [300, 5, 2100, 90, 1],  # 2100: its spans split between threads
    "sixteen alike": [90] * 16,
}


def _reference(q, k_cache, v_cache, tables, lens, scale, softcap, window=0):
    """float64: each row's scores over the keys it sees, capped, softmaxed, times the values."""
    dim, group = q.shape[-1], HEADS // KV_HEADS
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        lo = max(0, n - window) if window else 0
        ids = tables[b, : -(-n // BLOCK)]
        k = k_cache[ids].reshape(-1, KV_HEADS, dim)[lo:n].double().repeat_interleave(group, 1)
        v = v_cache[ids].reshape(-1, KV_HEADS, dim)[lo:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * scale  # (H, keys)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs).float()  # (B, H, D)


def _tables(lengths, num_blocks, gen):
    """Scattered blocks per row."""
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = torch.zeros(len(lengths), -(-max(lengths) // BLOCK), dtype=torch.long), 0
    for b, n in enumerate(lengths):
        count = -(-n // BLOCK)
        tables[b, :count] = order[used : used + count]
        used += count
    return tables


def _float_pool(lengths, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 + sum(-(-n // BLOCK) for n in lengths)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), HEADS, dim, generator=gen) * 3  # scores of a few units
    return q, k_cache, v_cache, _tables(lengths, num_blocks, gen), torch.tensor(lengths)


def _kind(window: int, softcap: float) -> dict:
    return {**({"window": window} if window else {}), "softcap": softcap}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("window", [0, 33])
@pytest.mark.parametrize("softcap", [2.0, 50.0])
@pytest.mark.parametrize("case", sorted(CASES))
def test_float_pools_soft_cap_the_scores(dtype, dim, window, softcap, case):
    q, k_cache, v_cache, tables, lens = _float_pool(CASES[case], dim, dtype, dim + window)
    scale = dim**-0.5
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                     **_kind(window, softcap))  # fmt: skip
    want = _reference(q, k_cache, v_cache, tables, lens, scale, softcap, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if softcap == 2.0:  # the check can fail: uncapped, the output is another
        plain = _reference(q, k_cache, v_cache, tables, lens, scale, 0.0, window)
        assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("softcap", [2.0, 50.0])
@pytest.mark.parametrize("case", ["mixed", "sixteen alike"])
def test_int8_pool_soft_caps_the_scores(window, softcap, case):
    lengths = CASES[case]
    gen = torch.Generator().manual_seed(window + len(lengths))
    dim = 64
    num_blocks = 4 + sum(-(-n // BLOCK) for n in lengths)
    cache = make_kv_cache(KVSpec(1, KV_HEADS, dim, BLOCK, "int8"), num_blocks)
    slots = torch.arange(num_blocks * BLOCK)
    cache.write(0, slots, torch.randn(len(slots), KV_HEADS, dim, generator=gen),
                torch.randn(len(slots), KV_HEADS, dim, generator=gen))  # fmt: skip
    k_deq, v_deq = (x.view(num_blocks, BLOCK, KV_HEADS, dim)
                    for x in cache.gather(0, torch.arange(num_blocks).unsqueeze(0)))  # fmt: skip
    tables = _tables(lengths, num_blocks, gen)
    q = torch.randn(len(lengths), HEADS, dim, generator=gen) * 3
    lens = torch.tensor(lengths)
    got = ops.paged_decode_attention_int8(q, cache.k_blocks[0], cache.v_blocks[0], tables, lens,
                                          dim**-0.5, BLOCK, **_kind(window, softcap))  # fmt: skip
    want = _reference(q, k_deq, v_deq, tables, lens, dim**-0.5, softcap, window)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    for row in range(len(lengths)):  # each row's bits as when it runs alone
        alone = ops.paged_decode_attention_int8(q[row : row + 1], cache.k_blocks[0],
                                                cache.v_blocks[0], tables[row : row + 1],
                                                lens[row : row + 1], dim**-0.5, BLOCK,
                                                **_kind(window, softcap))  # fmt: skip
        assert torch.equal(alone[0], got[row]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("window", [0, 64])
def test_rows_alone_and_batched_are_bit_identical(dtype, dim, window):
    """Decode rows of their own tables and a prefill chunk's rows sharing one table (the rows
    that see a whole span computed together), in one call and one at a time."""
    gen = torch.Generator().manual_seed(dim + window)
    lengths = [2100, 300, 5, 90]
    num_blocks = 80 + 4 + sum(-(-n // BLOCK) for n in lengths)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, dim, generator=gen).to(dtype)
    decode_tables = _tables(lengths, num_blocks - 80, gen)
    chunk_table = torch.arange(num_blocks - 80, num_blocks)  # 80 blocks: 1,280 keys
    width = max(decode_tables.shape[1], len(chunk_table))
    tables = torch.full((len(lengths) + 200, width), -1, dtype=torch.long)
    tables[: len(lengths), : decode_tables.shape[1]] = decode_tables
    tables[len(lengths) :, : len(chunk_table)] = chunk_table
    lens = torch.tensor(lengths + list(range(1001, 1201)))  # positions 1000 .. 1199
    q = torch.randn(len(lens), HEADS, dim, generator=gen) * 3
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5,
                                     **_kind(window, 2.0))  # fmt: skip
    want = _reference(q, k_cache, v_cache, tables, lens, dim**-0.5, 2.0, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for row in (0, 1, 2, 3, 4, 5, 37, 203):
        alone = ops.paged_decode_attention(q[row : row + 1], k_cache, v_cache,
                                           tables[row : row + 1], lens[row : row + 1],
                                           dim**-0.5, **_kind(window, 2.0))  # fmt: skip
        assert torch.equal(alone[0], got[row]), row


def test_softcap_zero_is_no_cap_and_a_negative_one_is_refused():
    q, k_cache, v_cache, tables, lens = _float_pool([300, 7], 64, torch.float32, 5)
    plain = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    zero = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, softcap=0.0)
    assert torch.equal(zero, plain)
    windowed = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window=40)
    assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                  window=40, softcap=0.0), windowed)  # fmt: skip
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, softcap=-1.0)


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_the_torch_path_caps_as_the_kernels_do(kv):
    """One step of decodes and prefill chunks (from position 0 and continuing a cached
    prefix) through the backend's torch path (explicit scores for a capped layer) and through
    its paged kernel: a capped windowed layer, a capped full one, an uncapped one."""
    from kvwise.core.outputs import ScheduledRequest, SchedulerOutput
    from kvwise.types import SamplingParams
    from kvwise.worker.attention import LayerAttention
    from kvwise.worker.attention_backend import make_attention
    from kvwise.worker.input_batch import build_input_batch

    dim = 64
    layers = [LayerAttention(40, 0.1, 2.0), LayerAttention(0, dim**-0.5, 5.0),
              LayerAttention(0, dim**-0.5)]  # fmt: skip
    spec = KVSpec(len(layers), KV_HEADS, dim, BLOCK, kv)
    shapes = [(1, 300), (1, 20), (120, 0), (30, 0), (50, 200)]  # (new tokens, start position)
    scheduled, first = [], 0
    for i, (n, start) in enumerate(shapes):
        count = -(-(start + n) // BLOCK)
        scheduled.append(ScheduledRequest(f"r{i}", [0] * n, start, list(range(first, first + count)),
                                          True, SamplingParams(), 0))  # fmt: skip
        first += count
    meta = build_input_batch(SchedulerOutput(scheduled=scheduled), BLOCK).attn_meta
    gen = torch.Generator().manual_seed(11)
    caches = [make_kv_cache(spec, first + 1, torch.float32, use) for use in (True, False)]
    everything = torch.arange((first + 1) * BLOCK)  # earlier contexts: the same K/V in both
    old_k = torch.randn(len(everything), KV_HEADS, dim, generator=gen)
    old_v = torch.randn(len(everything), KV_HEADS, dim, generator=gen)
    for cache in caches:
        for layer in range(len(layers)):
            cache.write(layer, everything, old_k, old_v)
        cache.begin_step([], meta.slot_mapping)
    rows = meta.slot_mapping.numel()
    q = torch.randn(rows, HEADS, dim, generator=gen) * 3
    k = torch.randn(rows, KV_HEADS, dim, generator=gen)
    v = torch.randn(rows, KV_HEADS, dim, generator=gen)
    kernel = make_attention(caches[0], HEADS, dim, layers=layers)
    torch_path = make_attention(caches[1], HEADS, dim, paged_kernel=False, layers=layers)
    assert kernel.paged_kernel and not torch_path.paged_kernel
    for layer in range(len(layers)):
        got = torch_path.bind(meta)(layer, q, k, v)
        want = kernel.bind(meta)(layer, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
