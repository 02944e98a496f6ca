"""Block metadata, the free-block queue and the block pool. Pure Python, no tensors.

Contract:
- Every block is either *used* (``ref_cnt > 0``, in some request's block table) or *free*
  (``ref_cnt == 0``, in the free queue). ``num_free + num_used == num_blocks`` always.
- A free block may still hold a cached hash (lazy eviction): it stays reusable through
  ``get_cached_block`` until ``get_new_blocks`` takes it for new work, which evicts it.
- The free queue's order *is* the eviction order: the head is taken first. Freed cached
  blocks are appended at the tail, so the least recently freed block goes first; callers free
  a sequence's blocks tail-first so that, within one sequence, its tail is evicted before its
  head (the head is more likely to be shared by the next request). Freed blocks without a
  hash hold nothing worth keeping and go to the head, so they are reused before any cached
  block is evicted.
- Retention: a block a request asked to keep (``retain``) goes, once free, to a second queue
  that is evicted only when the main queue is empty, and returns to the main queue (at its
  head: it is old) when its time runs out. A per-tenant cap bounds how many blocks one tenant
  may keep, so no tenant can hold the whole pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvwise.core.hashing import BlockHash
from kvwise.core.kv_events import KVEventLog


class KVBlock:
    """Metadata of one KV block; the tensors live in the worker under the same ``block_id``."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "prev_free",
        "next_free",
        "retain_until",
        "tenant",
        "reported",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.retain_until = 0.0  # > 0: kept until this time (pool clock); 0: not kept
        self.tenant: str | None = None  # who keeps it (for the per-tenant cap)
        self.reported = False  # its hash went out as a KV event (its eviction goes too)
        # NOTE: the free queue is threaded through the blocks so that removing a cached
        # block from the middle of the queue (a prefix hit on a free block) is O(1).
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        assert prev is not None and prev.next_free is not None
        nxt = prev.next_free
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            nxt = block.next_free
            yield block
            block = nxt

    def block_ids(self) -> list[int]:
        """The queue in eviction order (for tests and the integrity check)."""
        return [block.block_id for block in self]


class BlockPool:
    """Owns every ``KVBlock``: allocation, reference counts, the hash → block index."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        max_retained_blocks_per_tenant: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        events: KVEventLog | None = None,
        null_block: bool = False,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.clock = clock
        self.max_retained_per_tenant = (
            num_blocks // 2
            if max_retained_blocks_per_tenant is None
            else max_retained_blocks_per_tenant
        )
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # null_block: block 0 is set aside (held for ever, neither used nor free), for the
        # table slots of a windowed group's blocks that fell out of its window
        self.null_block = self.blocks[0] if null_block else None
        if self.null_block is not None:
            if num_blocks < 2:
                raise ValueError(f"num_blocks: a null block needs two or more, got {num_blocks}")
            self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:] if null_block else self.blocks)
        self.retained_queue = FreeBlockQueue(())  # free blocks still kept, in free order
        self.num_retained: dict[str, int] = {}  # tenant -> blocks it keeps (used or free)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.events = events  # KV events for routers: hashes cached and evicted (optional)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks + self.retained_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks - (self.null_block is not None)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable hash."""
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their hashes; returned
        in ascending block id order."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        if num_blocks > self.free_queue.num_free_blocks:
            self.expire_retention()
        blocks = []
        for _ in range(num_blocks):
            if self.free_queue.num_free_blocks:
                block = self.free_queue.popleft()
            else:  # kept blocks go last, oldest first
                block = self.retained_queue.popleft()
                self._unretain(block)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        # NOTE: the queue hands back freed blocks tail-first (a sequence frees its tail
        # first), so a batch popped in queue order runs backwards through memory: every block
        # a separate copy when KV is loaded into them. The same blocks in ascending order are
        # as good for the cache and keep neighbouring ids together.
        blocks.sort(key=lambda b: b.block_id)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); revive free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                queue = self.retained_queue if block.retain_until else self.free_queue
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's tail in
        the given order (so pass a sequence's blocks tail-first)."""
        now = self.clock()
        empty = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.retain_until and block.retain_until <= now:
                    self._unretain(block)
                if block.block_hash is None:
                    empty.append(block)
                else:
                    queue = self.retained_queue if block.retain_until else self.free_queue
                    queue.append(block)
        # NOTE: a block without a hash holds nothing reusable: it goes to the head, to be
        # reused before any cached block is evicted (and its neighbours' ids stay together).
        for block in reversed(empty):
            self.free_queue.appendleft(block)

    # ---- retention ----------------------------------------------------------------------

    def retain(self, blocks: Iterable[KVBlock], tenant: str, until: float) -> int:
        """Keep cached blocks until ``until`` (pool clock) on ``tenant``'s account.

        A block already kept has its time extended. A tenant at its cap keeps no more.
        Returns the number of blocks newly kept.
        """
        added = 0
        for block in blocks:
            if block.block_hash is None:
                continue
            if block.retain_until:
                block.retain_until = max(block.retain_until, until)
                continue
            if self.num_retained.get(tenant, 0) >= self.max_retained_per_tenant:
                break
            block.retain_until = until
            block.tenant = tenant
            self.num_retained[tenant] = self.num_retained.get(tenant, 0) + 1
            added += 1
            if block.ref_cnt == 0:  # a free block moves to the kept queue
                self.free_queue.remove(block)
                self.retained_queue.append(block)
        return added

    def expire_retention(self) -> int:
        """Move free kept blocks whose time ran out to the head of the main queue."""
        now = self.clock()
        expired = [b for b in self.retained_queue if b.retain_until <= now]
        for block in reversed(expired):  # keep their relative order at the head
            self.retained_queue.remove(block)
            self._unretain(block)
            self.free_queue.appendleft(block)
        return len(expired)

    def _unretain(self, block: KVBlock) -> None:
        if block.retain_until and block.tenant is not None:
            self.num_retained[block.tenant] -= 1
            if not self.num_retained[block.tenant]:
                del self.num_retained[block.tenant]
        block.retain_until = 0.0
        block.tenant = None

    def cache_blocks(
        self,
        blocks: list[KVBlock],
        block_hashes: list[BlockHash],
        start: int = 0,
        events: bool = True,
    ) -> None:
        """Record that ``blocks[i]`` holds the full block hashed ``block_hashes[i]``, for
        ``i >= start``; ``events``: report them (a hybrid pool reports its group 0 only)."""
        if not self.enable_caching:
            return
        run: list[BlockHash] = []  # newly cached consecutive hashes, for one event
        parent: BlockHash | None = None
        log = self.events if events else None
        for i in range(start, min(len(blocks), len(block_hashes))):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None or block_hash in self.cached:
                # already cached (a prefix hit, an earlier step) or computed twice by two
                # requests at once (the first copy stays)
                if log is not None and run:
                    log.stored(run, parent)
                run = []
                continue
            block.block_hash = block_hash
            block.reported = log is not None
            self.cached[block_hash] = block
            if not run:
                parent = block_hashes[i - 1] if i else None
            run.append(block_hash)
        if log is not None and run:
            log.stored(run, parent)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None and block.reported:  # (a hybrid pool's group 0 only)
                self.events.removed([block.block_hash])
        block.reported = False
        self.num_evictions += 1
        block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of a free block. Returns how many were dropped."""
        dropped = 0
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                if block.retain_until:
                    self.retained_queue.remove(block)
                    self._unretain(block)
                    self.free_queue.append(block)
                self._evict(block)
                dropped += 1
        return dropped

    def drop_cached(self, block_hashes: Iterable[BlockHash]) -> int:
        """Forget the given hashes where their blocks are free (parking a conversation whose
        KV is safe in a slower tier); blocks in use are left alone. The dropped blocks go to
        the head of the main queue, to be reused first. Returns how many were dropped."""
        dropped = 0
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None or block.ref_cnt:
                continue
            queue = self.retained_queue if block.retain_until else self.free_queue
            queue.remove(block)
            self._unretain(block)
            self._evict(block)
            self.free_queue.appendleft(block)
            dropped += 1
        return dropped

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's invariants do not hold."""
        free_ids = self.free_queue.block_ids()
        kept_ids = self.retained_queue.block_ids()
        all_free = free_ids + kept_ids
        assert len(all_free) == len(set(all_free)) == self.num_free_blocks, "free queues corrupt"
        assert all(self.blocks[i].retain_until for i in kept_ids), "unkept block in kept queue"
        assert not any(self.blocks[i].retain_until for i in free_ids), "kept block in main queue"
        counts: dict[str, int] = {}
        for block in self.blocks:
            in_queue = block.prev_free is not None
            assert in_queue == (block.ref_cnt == 0), f"{block}: queue membership vs ref_cnt"
            assert block.ref_cnt >= 0
            if block.retain_until:
                assert block.tenant is not None and block.block_hash is not None
                counts[block.tenant] = counts.get(block.tenant, 0) + 1
        assert counts == self.num_retained, "per-tenant kept counts out of date"
        assert all(n <= self.max_retained_per_tenant for n in counts.values())
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block}: index out of date"
        reserved = self.null_block is not None
        assert self.num_free_blocks + self.num_used_blocks + reserved == self.num_blocks
