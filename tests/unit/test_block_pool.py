"""Block pool and free queue: exact block ids and eviction order."""

import pytest

from kvwise.core.block_pool import BlockPool


def test_allocation_takes_blocks_in_queue_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [5]
    pool.check_integrity()


def test_freed_cached_blocks_join_tail_in_given_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2
    pool.cache_blocks(blocks, [b"h0", b"h1", b"h2"])
    pool.free_blocks(reversed(blocks))  # tail first
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    # the queue's head is taken (3, then 2: block 1 and 0 keep their hashes), in id order
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 3]
    assert set(pool.cached) == {b"h0", b"h1"}


def test_a_batch_of_reused_blocks_comes_in_ascending_order():
    # a sequence frees its tail first, so its blocks rejoin the queue backwards; taken again
    # together they must not run backwards through memory (each block a separate copy when
    # KV is loaded into them)
    pool = BlockPool(8)
    first = pool.get_new_blocks(8)
    pool.cache_blocks(first, [bytes([i]) for i in range(8)])
    pool.free_blocks(reversed(first))
    again = [b.block_id for b in pool.get_new_blocks(8)]
    assert again == list(range(8))


def test_freed_blocks_without_hash_go_to_head_before_cached_ones():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 0, 1: cached
    b = pool.get_new_blocks(2)  # 2, 3: never filled (no hash)
    pool.cache_blocks(a, [b"h0", b"h1"])
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert pool.free_queue.block_ids() == [3, 2, 4, 1, 0]
    # new work takes the empty blocks first and evicts nothing
    pool.get_new_blocks(3)
    assert {h: x.block_id for h, x in pool.cached.items()} == {b"h0": 0, b"h1": 1}
    assert pool.num_evictions == 0


def test_lazy_eviction_keeps_hash_until_reused():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a, b], [b"h0", b"h1"])
    assert pool.cached == {b"h0": a, b"h1": b}
    pool.free_blocks([b, a])
    assert pool.num_free_blocks == 3
    # still reusable while free
    assert pool.get_cached_block(b"h0") is a
    assert pool.num_cached_free_blocks == 2
    # revive a: it leaves the free queue from the middle
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 1]
    # taking new blocks evicts b's hash (head of queue after block 2)
    new = pool.get_new_blocks(2)
    assert [x.block_id for x in new] == [1, 2]  # the queue's head (2, then 1), in id order
    assert pool.get_cached_block(b"h1") is None
    assert pool.cached == {b"h0": a} and b.block_hash is None
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_shared_block_needs_every_reference_freed():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])


def test_over_allocation_is_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_duplicate_hash_keeps_first_copy():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [b"h"])
    pool.cache_blocks([b], [b"h"])
    assert pool.get_cached_block(b"h") is a
    assert b.block_hash is None


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_blocks([a], [b"h"])
    assert pool.get_cached_block(b"h") is None
