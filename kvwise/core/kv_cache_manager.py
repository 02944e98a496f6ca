"""Maps requests to KV blocks: prefix lookup, slot allocation, caching of full blocks, freeing.

Token ranges of one request (block_size 4)::

    token_ids:   | p p p p | p p p p | p p o o | o         |
    blocks:      | blk 7   | blk 2   | blk 9   | blk 4     |
                 |<- cached prefix ->|<- computed ->|<- new (this step) ->|
                 0                   8          num_computed    num_computed + num_new

Only full blocks are hashed and cached. A prompt that is entirely cached still computes its
last token, so a prefix hit covers at most ``(num_tokens - 1) // block_size`` blocks.

Isolation: a request's hashes descend from the root of its (model, tenant, salt), so a hit
is only possible within the same tenant and salt. The one exception is an operator-declared
public prefix: the part of a prompt that matches one, rounded down to whole chunks of
``public_min_tokens``, hashes under the public root and is shared by every tenant. The
chunking means a tenant can learn at most "this N-token chunk of a declared public prefix is
cached", never another tenant's prompt token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvwise.core.block_pool import BlockPool, KVBlock
from kvwise.core.hashing import BlockHash, BlockHasher
from kvwise.core.kv_events import KVEvent, KVEventLog
from kvwise.core.request import Request
from kvwise.core.stat_fields import GAUGE, metric


@dataclass(frozen=True)
class KVCacheStats:
    """The device pool at one moment; token counts are totals since start. Each field names
    its metric (``core.stat_fields``)."""

    blocks_total: int = metric("kvwise_kv_blocks_total", "KV blocks in the pool", GAUGE)
    blocks_used: int = metric("kvwise_kv_blocks_used", "KV blocks held by requests", GAUGE)
    blocks_cached_free: int = metric(  # free, still holding a reusable cached prefix
        "kvwise_kv_blocks_cached", "free KV blocks still holding a cached prefix", GAUGE
    )
    blocks_free: int = metric("kvwise_kv_blocks_free", "free KV blocks", GAUGE)
    blocks_kept: int = metric(
        "kvwise_kv_blocks_kept", "KV blocks kept by retention (used or free)", GAUGE
    )
    prefix_query_tokens: int = metric(
        "kvwise_prefix_cache_queries_tokens", "prompt tokens looked up in the prefix cache"
    )
    prefix_hit_tokens: int = metric(
        "kvwise_prefix_cache_hits_tokens", "prompt tokens found in the prefix cache"
    )
    utilization: float = metric(  # tokens held by running sequences / capacity of their blocks
        "kvwise_kv_utilization", "share of allocated KV slots holding computed tokens", GAUGE
    )

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        model_fingerprint: str = "",
        public_prefixes: Sequence[Sequence[int]] = (),
        public_min_tokens: int = 256,
        max_retained_blocks_per_tenant: int | None = None,
        clock: Callable[[], float] | None = None,
        kv_events: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        if public_min_tokens < block_size:
            raise ValueError(
                f"public_min_tokens: must be at least block_size ({block_size}), "
                f"got {public_min_tokens}"
            )
        self.block_size = block_size
        self.released: list[int] = []  # see take_released
        self.enable_caching = enable_caching
        self.model_fingerprint = model_fingerprint
        self.public_prefixes = [list(p) for p in public_prefixes]
        self.public_min_tokens = public_min_tokens
        kwargs = {} if clock is None else {"clock": clock}
        # KV events for cache-aware routers (take_kv_events); off: nothing is recorded
        self.events = KVEventLog(block_size) if kv_events else None
        kwargs["events"] = self.events
        self.pool = BlockPool(
            num_blocks,
            enable_caching,
            max_retained_blocks_per_tenant,
            **kwargs,
        )
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # the hash chains (shared with routers: core/hashing.py); owns the public prefixes
        self.hasher = BlockHasher(
            model_fingerprint, block_size, self.public_prefixes, public_min_tokens
        )
        # prefix-cache statistics, in tokens
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def add_public_prefix(self, token_ids: Sequence[int]) -> None:
        """Declare a prefix every tenant may share (in whole chunks of ``public_min_tokens``)."""
        self.public_prefixes.append(list(token_ids))

    def drop_cached(self, block_hashes: Iterable[BlockHash]) -> int:
        """Forget the cached blocks with these hashes where they are free (their KV is safe in
        a slower tier); blocks in use stay. Returns how many were dropped."""
        return self.pool.drop_cached(block_hashes)

    def stats(self, running: Sequence[Request] = ()) -> KVCacheStats:
        """The pool now; ``running``: the live sequences whose utilisation to report."""
        pool = self.pool
        return KVCacheStats(
            blocks_total=pool.num_blocks,
            blocks_used=pool.num_used_blocks,
            blocks_cached_free=pool.num_cached_free_blocks,
            blocks_free=pool.num_free_blocks,
            blocks_kept=sum(pool.num_retained.values()),
            prefix_query_tokens=self.num_prefix_query_tokens,
            prefix_hit_tokens=self.num_prefix_hit_tokens,
            utilization=self.kv_utilization(running),
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_public_blocks(self, token_ids: Sequence[int]) -> int:
        """Leading blocks of ``token_ids`` shared as a public prefix (whole chunks only)."""
        return self.hasher.num_public_blocks(token_ids)

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover the full blocks of the first tokens."""
        if request.num_public_blocks is None:
            prompt = request.token_ids[: request.num_prompt_tokens]
            request.num_public_blocks = self.num_public_blocks(prompt)
        self.hasher.extend(
            request.block_hashes, request.token_ids, num_tokens, request.tenant,
            request.cache_salt, request.num_public_blocks,
        )  # fmt: skip

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request: (blocks, number of tokens they hold).

        Does not take references; pass the blocks to ``allocate_slots``.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks * self.block_size)
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.num_prefix_query_tokens += request.num_tokens
        self.num_prefix_hit_tokens += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a waiting request's prompt its pool holds now (a load estimate: counts
        nothing, takes nothing)."""
        if not self.enable_caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks * self.block_size)
        n = 0
        for block_hash in request.block_hashes[:max_blocks]:
            if self.pool.get_cached_block(block_hash) is None:
                break
            n += 1
        return n * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` after the computed ones.

        Returns the request's whole block table (block ids), or None when the pool lacks free
        blocks (nothing is changed then).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_to_allocate = num_required - len(blocks) - len(new_computed_blocks)
        # reviving a free cached block also takes it out of the free queue
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_to_allocate + num_revived > self.pool.num_free_blocks:
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks = blocks + new_computed_blocks
        if num_to_allocate > 0:
            blocks = blocks + self.pool.get_new_blocks(num_to_allocate)
        self.req_to_blocks[request.request_id] = blocks
        return [b.block_id for b in blocks]

    def cache_full_blocks(self, request: Request) -> None:
        """Record the request's computed full blocks in the prefix index."""
        if not self.enable_caching:
            return
        self._update_block_hashes(request, request.num_computed_tokens)
        num_full = request.num_computed_tokens // self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.pool.cache_blocks(blocks[:num_full], request.block_hashes[:num_full])
        if request.retention_s:
            until = self.pool.clock() + request.retention_s
            self.pool.retain(blocks[:num_full], request.tenant, until)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its head)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.released.extend(b.block_id for b in blocks if b.block_hash is None)
        self.pool.free_blocks(reversed(blocks))

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the device pool holds (a router's snapshot of this pool)."""
        return list(self.pool.cached)

    def take_kv_events(self) -> list[KVEvent]:
        """The pool's KV events since the last call (none when ``kv_events`` is off)."""
        return self.events.drain() if self.events is not None else []

    def take_released(self) -> list[int]:
        """Ids of blocks freed without a hash (open tails) since the last call: the worker
        drops whatever it keeps beside them (int4's staged keys)."""
        released, self.released = self.released, []
        return released

    def check_integrity(self) -> None:
        """Assert reference counts equal the number of live block tables holding each block."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), "a block appears twice in one table"
            for block_id in ids:
                counts[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == counts[block.block_id], f"{block}: ref_cnt != tables holding it"

    def kv_utilization(self, requests: Sequence[Request]) -> float:
        """Tokens held by live sequences / token capacity of the blocks they hold."""
        held = capacity = 0
        for request in requests:
            num_blocks = len(self.req_to_blocks.get(request.request_id, ()))
            capacity += num_blocks * self.block_size
            held += min(request.num_computed_tokens, num_blocks * self.block_size)
        return held / capacity if capacity else 1.0
