"""The int4 kernel's sliding window (``window=W``) and score soft cap (``softcap=c``), as the
float and int8 kernels take them (test_sliding_window_kernels, test_softcap_kernels).

Against a float64 reference over the keys and values the int4 pool holds (sealed blocks
dequantized; a row's own block from its staging slot), windows from 1 key to longer than the
context, with and without a cap; rows alone and batched bit-identical (decode rows with their
own tables, a prefill chunk's rows sharing one table across the window's edge); blocks wholly
before the window never read (their table entries -1, as a sliding-window group's freed
blocks); window 0 and softcap 0 the same bits as none, negatives refused; and the backend's
torch path (gathered sealed blocks, the open block's staged keys) as the kernel attends, each
layer its own window, scale and cap.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import make_kv_cache
from tests.attention_util import torch_path_against_kernel
from tests.unit.test_kernels import _scattered_tables

if not kernels.available():
    if os.environ.get("CI"):
        pytest.fail("the kvwise kernels did not build in CI", pytrace=False)
    pytest.skip("the kvwise kernels are unavailable here", allow_module_level=True)

ops = torch.ops.kvwise
HEADS, KV_HEADS, DIM, BLOCK, GROUP = 8, 2, 64, 32, 32
CASES = {
    "one decode": [1],
    "short decodes": [17, 5, 64, 1],
    "mixed": [300, 5, 2100, 90, 1],  # 2100: a long row among short ones
    "sixteen alike": [90] * 16,
}


def _sealed_pool(num_blocks: int, gen: torch.Generator):
    """A one-layer int4 pool, every block written whole (so sealed), and its K/V dequantized
    ``(num_blocks, BLOCK, KV_HEADS, DIM)`` each."""
    cache = make_kv_cache(KVSpec(1, KV_HEADS, DIM, BLOCK, "int4"), num_blocks, torch.float32)
    k = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen) * 2
    v = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen)
    for first in range(0, num_blocks * BLOCK, BLOCK):
        block = torch.arange(first, first + BLOCK)
        cache.begin_step(slot_mapping=block)
        cache.write(0, block, k[first : first + BLOCK], v[first : first + BLOCK])
    every = torch.arange(num_blocks).unsqueeze(0)
    k_deq, v_deq = (x.view(num_blocks, BLOCK, KV_HEADS, DIM) for x in cache.gather(0, every))
    return cache, k_deq, v_deq


def _attend(cache, k_deq, q, tables, lens, window=0, softcap=0.0):
    """The kernel, each row's own block's keys from a staging slot of its dequantized keys
    (what a sealed block's staged rows would be)."""
    own = tables.gather(1, ((lens - 1) // BLOCK).unsqueeze(1)).squeeze(1)
    staged = k_deq[own].contiguous()  # (rows, BLOCK, KV_HEADS, DIM)
    return ops.paged_decode_attention_int4(q, cache.k_blocks[0], cache.v_blocks[0], staged,
                                           tables, lens, torch.arange(len(lens)), DIM**-0.5,
                                           BLOCK, GROUP, window=window, softcap=softcap)  # fmt: skip


def _reference(q, k_deq, v_deq, tables, lens, window=0, softcap=0.0):
    """float64: each row's scores over the keys it sees, capped, softmaxed, times the values."""
    group, outs = HEADS // KV_HEADS, []
    for b in range(q.shape[0]):
        n = int(lens[b])
        lo = max(0, n - window) if window else 0
        ids = tables[b, : -(-n // BLOCK)].clamp(min=0)
        k = k_deq[ids].reshape(-1, KV_HEADS, DIM)[lo:n].double().repeat_interleave(group, 1)
        v = v_deq[ids].reshape(-1, KV_HEADS, DIM)[lo:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * DIM**-0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs).float()


def _setup(lengths, seed, extra_blocks=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 + extra_blocks + sum(-(-n // BLOCK) for n in lengths)
    cache, k_deq, v_deq = _sealed_pool(num_blocks, gen)
    tables = _scattered_tables(lengths, BLOCK, num_blocks - extra_blocks, gen)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen) * 3
    return gen, cache, k_deq, v_deq, tables, q


@pytest.mark.parametrize("window", [1, 5, 32, 33, 100, 4096])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("case", sorted(CASES))
def test_int4_attends_within_the_window_and_caps_the_scores(window, softcap, case):
    lengths = CASES[case]
    _, cache, k_deq, v_deq, tables, q = _setup(lengths, window + len(lengths))
    lens = torch.tensor(lengths)
    got = _attend(cache, k_deq, q, tables, lens, window, softcap)
    want = _reference(q, k_deq, v_deq, tables, lens, window, softcap)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    for row in range(len(lengths)):  # each row's bits as when it runs alone
        alone = _attend(cache, k_deq, q[row : row + 1], tables[row : row + 1],
                        lens[row : row + 1], window, softcap)  # fmt: skip
        assert torch.equal(alone[0], got[row]), row
    if softcap and min(window, max(lengths)) > 1:  # can fail: uncapped, another output
        plain = _reference(q, k_deq, v_deq, tables, lens, window)
        assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize("window", [7, 64, 300])
def test_prefill_rows_across_the_windows_edge_are_their_own_bits(window):
    """A chunk's rows (one table, positions window - 5 .. window + 694, grouped eight at a
    time over shared blocks) against the reference, each row as when it runs alone."""
    gen, cache, k_deq, v_deq, _, _ = _setup([1000], window)
    table = _scattered_tables([1000], BLOCK, k_deq.shape[0], gen)[0]
    lens = torch.arange(window - 4, window + 696)
    tables = table.expand(len(lens), -1).contiguous()
    q = torch.randn(len(lens), HEADS, DIM, generator=gen) * 3
    got = _attend(cache, k_deq, q, tables, lens, window, 3.0)
    torch.testing.assert_close(got, _reference(q, k_deq, v_deq, tables, lens, window, 3.0),
                               atol=5e-5, rtol=1e-4)  # fmt: skip
    for row in (0, 4, 5, 6, 7, 8, 350, 699):
        alone = _attend(cache, k_deq, q[row : row + 1], tables[row : row + 1],
                        lens[row : row + 1], window, 3.0)  # fmt: skip
        assert torch.equal(alone[0], got[row]), row


def test_blocks_before_the_window_are_never_read():
    lengths, window = [2100, 700, 33], 100
    _, cache, k_deq, _, tables, q = _setup(lengths, 3)
    lens = torch.tensor(lengths)
    want = _attend(cache, k_deq, q, tables, lens, window)
    freed = tables.clone()
    for b, n in enumerate(lengths):
        freed[b, : max(0, n - window) // BLOCK] = -1  # gone, as a sliding group frees them
    assert torch.equal(_attend(cache, k_deq, q, freed, lens, window), want)
    with pytest.raises(RuntimeError, match="block id"):  # and without the window they are read
        _attend(cache, k_deq, q, freed, lens)


def test_zero_is_none_and_negatives_are_refused():
    _, cache, k_deq, _, tables, q = _setup([300, 7], 5)
    lens = torch.tensor([300, 7])
    plain = _attend(cache, k_deq, q, tables, lens)
    assert torch.equal(_attend(cache, k_deq, q, tables, lens, 0, 0.0), plain)
    assert torch.equal(_attend(cache, k_deq, q, tables, lens, 300), plain)  # covers everything
    assert not torch.equal(_attend(cache, k_deq, q, tables, lens, 299), plain)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        _attend(cache, k_deq, q, tables, lens, -1)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        _attend(cache, k_deq, q, tables, lens, 0, -1.0)


def test_the_torch_path_attends_as_the_int4_kernel_does():
    """One step of decodes (contexts past and inside the window, own blocks partly staged) and
    prefill chunks (from position 0 longer than the window; continuing a cached prefix from
    mid-block) through the backend's torch path and its int4 kernel: a capped windowed layer,
    a windowed one, a capped full one, a plain one."""
    from kvwise.worker.attention import LayerAttention

    layers = [LayerAttention(40, 0.1, 2.0), LayerAttention(70, DIM**-0.5),
              LayerAttention(0, DIM**-0.5, 5.0), LayerAttention(0, DIM**-0.5)]  # fmt: skip
    shapes = [(300, 1), (20, 1), (41, 1), (0, 120), (200, 50)]  # (cached tokens, new tokens)
    torch_path_against_kernel(layers, "int4", shapes, HEADS, KV_HEADS, DIM, BLOCK)
