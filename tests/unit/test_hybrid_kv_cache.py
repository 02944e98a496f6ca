"""The hybrid KV cache's bookkeeping (core/, no tensors): KV groups by attention kind, windowed
groups freeing the blocks that leave their window, exact prefix hits across groups."""

import pytest

from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_spec import KVGroup, KVSpec, first_window_block, kv_groups
from kvwise.core.request import Request
from kvwise.types import SamplingParams

P = SamplingParams(max_tokens=4)
BS, W = 4, 8  # a query sees its own key and the 7 before: blocks from (p - 7) // 4


def gemma3_windows(num_layers=18, window=512):
    return [0 if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_layers_make_six_groups_of_three_full_first():
    groups = kv_groups(gemma3_windows())
    assert groups[0] == KVGroup((5, 11, 17), 0)
    assert [g.window for g in groups] == [0, 512, 512, 512, 512, 512]
    assert groups[1].layers == (0, 1, 2) and groups[2].layers == (3, 4, 6)
    assert groups[-1].layers == (14, 15, 16)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))


def test_group_sizes():
    assert kv_groups([0, 0, 0]) == ()  # all full: one table, as before
    assert kv_groups([8, 8]) == (KVGroup((0, 1), 8),)  # one window: one windowed group
    # counts within 25%: one group each, the smaller one padded (5 of 6 slots)
    assert [len(g.layers) for g in kv_groups([0] * 5 + [8] * 6)] == [5, 6]
    # otherwise the fewest: 2 full, then 7 windowed in groups of 2 (the last one short)
    assert [len(g.layers) for g in kv_groups([0] * 2 + [8] * 7)] == [2, 2, 2, 2, 1]


def test_a_32k_gemma3_sequence_holds_about_a_fifth_of_all_full():
    groups = kv_groups(gemma3_windows())
    hybrid = KVSpec(3, 1, 256, 16, "float32", groups=groups)
    full = KVSpec(18, 1, 256, 16, "float32")
    ratio = hybrid.seq_bytes(32768) / full.seq_bytes(32768)
    assert 0.17 < ratio < 0.19, ratio  # 3 full layers + 15 x (512 + a block) of 18 x 32768
    assert hybrid.layout != full.layout and hybrid.layout.endswith(".Gf-512-512-512-512-512")


def _run(manager, request, chunk):
    """Compute a request's prompt chunk by chunk after its prefix hit; return how many
    blocks its last group holds after each chunk."""
    blocks, hit = manager.get_computed_blocks(request)
    held = []
    while hit < request.num_tokens:
        n = min(chunk, request.num_tokens - hit)
        tables = manager.allocate_slots(request, n, blocks)
        assert tables is not None
        blocks, hit = None, hit + n
        request.num_computed_tokens = hit
        manager.cache_full_blocks(request)
        manager.check_integrity()
        held.append(sum(1 for b in tables[-1] if b != manager.null_block.block_id))
    return held


def test_a_windowed_group_keeps_only_its_window():
    manager = KVCacheManager(64, BS, windows=(0, W))
    request = Request("a", list(range(60)), P)
    held = _run(manager, request, chunk=4)
    # at most the window's blocks before a chunk plus the chunk's: 8 keys -> 3 blocks
    assert max(held) <= 3 and held[-1] == 3
    tables = manager.req_to_blocks["a"]
    assert len(tables[0]) == 15 and all(b is not manager.null_block for b in tables[0])
    null = manager.null_block
    assert [b is null for b in tables[1]] == [True] * 12 + [False] * 3
    stats = manager.stats()
    assert stats.blocks_used == 15 + 3 and stats.blocks_total == 63  # the null block apart
    manager.free(request)
    manager.check_integrity()
    assert manager.pool.num_used_blocks == 0


def test_a_hit_needs_the_full_prefix_and_the_window_before_its_end():
    manager = KVCacheManager(64, BS, windows=(0, W))
    first = Request("a", list(range(40)), P)
    _run(manager, first, chunk=40)  # one chunk: every windowed block held until it is done
    manager.free(first)
    again = Request("b", list(range(40)), P)
    blocks, hit = manager.get_computed_blocks(again)
    assert hit == 36  # (40 - 1) // 4 blocks: the last token is computed
    null = manager.null_block
    start = first_window_block(W, BS, 36)  # the next token's window starts in block 7
    assert start == 7 and [b is null for b in blocks[1]] == [True] * 7 + [False] * 2
    assert all(b is not null for b in blocks[0])
    # the windowed group lost its block 8: the longest hit whose window is whole is shorter
    lost = manager.group_hashes(again, 1)[8]
    assert manager.pool.drop_cached([lost]) == 1
    blocks, hit = manager.get_computed_blocks(Request("c", list(range(40)), P))
    assert hit == 32 and [b is null for b in blocks[1]] == [True] * 6 + [False] * 2
    # and a full group's missing block cuts the hit where it is
    manager.pool.drop_cached([again.block_hashes[3]])
    assert manager.get_computed_blocks(Request("d", list(range(40)), P))[1] == 12


def test_a_hit_is_identical_whatever_chunking_computed_it():
    """Prefill in one chunk or many: the same hashes, the same hit (the window's blocks)."""
    for chunk in (40, 6):
        manager = KVCacheManager(64, BS, windows=(0, W))
        _run(manager, Request("a", list(range(40)), P), chunk)
        # still running: its blocks are in use, a hit all the same
        assert manager.get_computed_blocks(Request("b", list(range(40)), P))[1] == 36, chunk


def test_when_the_pool_is_short_nothing_changes():
    manager = KVCacheManager(8, BS, windows=(0, W))  # 7 usable blocks
    request = Request("a", list(range(40)), P)
    assert manager.allocate_slots(request, 40) is None
    assert manager.pool.num_used_blocks == 0 and "a" not in manager.req_to_blocks
    assert manager.blocks_for(40, 40) == 20 and manager.blocks_for(40, 4) == 13


def test_park_drops_every_groups_copy():
    manager = KVCacheManager(64, BS, windows=(0, W))
    request = Request("a", list(range(40)), P)
    _run(manager, request, chunk=40)
    manager.free(request)
    dropped = manager.drop_cached(request.block_hashes[:9])
    assert dropped == 9 + 9  # every full block, and the windowed group's (all held: 1 chunk)
    assert manager.get_computed_blocks(Request("b", list(range(40)), P))[1] == 0


@pytest.mark.parametrize("windows", [(W,), (0, W, W)])
def test_integrity_through_preemption_like_frees(windows):
    manager = KVCacheManager(80, BS, windows=windows)
    for i in range(5):
        request = Request(f"r{i}", list(range(i, i + 30)), P)
        _run(manager, request, chunk=5)
        if i % 2:
            manager.free(request)
    manager.check_integrity()


def test_the_cost_model_counts_every_groups_bytes_of_a_load():
    """A Gemma 3 load: group 0's plan, plus 0 more full groups and 5 windowed groups' window
    at its end: the windowed part stops growing once the load is past the window."""
    from kvwise.store.planner import other_groups_cost
    from kvwise.store.serde import EntryFormat

    spec = KVSpec(3, 1, 256, 16, "float32", groups=kv_groups(gemma3_windows()))
    extra = other_groups_cost(EntryFormat(spec, "m"), start=0, chunk_blocks=8)
    page = spec.block_bytes
    entries, num_bytes = extra(512)  # 8,192 tokens: 5 windows of 512 tokens + a block each
    window_blocks = 512 - first_window_block(512, 16, 512 * 16)
    assert window_blocks == 32 and entries == 5 * 4
    assert page * 5 * 32 < num_bytes < page * 5 * 32 * 1.01  # the entries' headers on top
    assert extra(1024)[1] == num_bytes  # twice as long: the same windows
    assert extra(4)[1] < num_bytes / 5  # shorter than the window: what there is
    assert other_groups_cost(EntryFormat(KVSpec(3, 1, 256, 16), "m"), 0, 8) is None


def test_routers_hear_of_group_0_only():
    """KV events name group 0's hashes (the chain a router computes), stored and evicted;
    the windowed group's own hashes never go out."""
    from kvwise.core.kv_events import BlockRemoved, BlockStored

    manager = KVCacheManager(24, BS, windows=(0, W), kv_events=True)
    first = Request("a", list(range(40)), P)
    _run(manager, first, chunk=40)
    manager.free(first)
    _run(manager, Request("b", list(range(100, 160)), P), chunk=4)  # evicts "a"'s blocks
    events = manager.take_kv_events()
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(first.block_hashes) <= stored
    assert removed and removed <= stored
    assert not stored & set(manager.group_hashes(first, 1))


@pytest.mark.parametrize("prompt_tokens,chunk", [(31, 8), (60, 8), (61, 12), (40, 16)])
def test_a_prompt_fits_a_pool_of_exactly_the_blocks_its_chunks_hold(prompt_tokens, chunk):
    """A pool of ``blocks_for(prompt + 1, chunk)`` blocks (what admission checks) computes the
    prompt chunk by chunk: the blocks a windowed group lets go at a chunk pay for its new
    ones (issue 45 item 6: Gemma 3 with a 40 MiB pool and 512-token steps answered a
    1,540-token prompt with 0 tokens, finish_reason length, its third chunk's allocation
    refused while the blocks leaving the window were still counted as held)."""
    probe = KVCacheManager(64, BS, windows=(0, W, W))
    need = probe.blocks_for(prompt_tokens + 1, chunk)
    manager = KVCacheManager(need + 1, BS, windows=(0, W, W))  # + the null block
    assert manager.num_blocks == need
    request = Request("a", list(range(prompt_tokens)), P)
    _run(manager, request, chunk)  # every allocation succeeds
    assert manager.allocate_slots(request, 1) is not None  # and its first answer token's
    manager.check_integrity()
    manager.free(request)
    assert manager.pool.num_used_blocks == 0
