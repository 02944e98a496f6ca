"""Maps requests to KV blocks: prefix lookup, slot allocation, caching of full blocks, freeing.

Token ranges of one request (block_size 4)::

    token_ids:   | p p p p | p p p p | p p o o | o         |
    blocks:      | blk 7   | blk 2   | blk 9   | blk 4     |
                 |<- cached prefix ->|<- computed ->|<- new (this step) ->|
                 0                   8          num_computed    num_computed + num_new

Only full blocks are hashed and cached. A prompt that is entirely cached still computes its
last token (for its logits): a hit covers ``(num_tokens - 1) // block_size`` blocks at most,
or with ``whole_hits`` all of a block-aligned prompt's (its last row then reads its K/V from
the pool and is not written: ``ScheduledRequest.kv_in_pool``; full-attention groups only).

Isolation: a request's hashes descend from the root of its (model, tenant, salt), so a hit
is only possible within the same tenant and salt. The one exception is an operator-declared
public prefix: the part of a prompt that matches one, rounded down to whole chunks of
``public_min_tokens``, hashes under the public root and is shared by every tenant. The
chunking means a tenant can learn at most "this N-token chunk of a declared public prefix is
cached", never another tenant's prompt token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvwise.core.block_pool import BlockPool, KVBlock
from kvwise.core.breakpoints import BreakpointKeeper, BreakpointPolicy
from kvwise.core.hashing import BlockHash, BlockHasher
from kvwise.core.kv_events import KVEvent, KVEventLog
from kvwise.core.kv_groups import make_group
from kvwise.core.kv_stats import KVCacheStats, kv_utilization
from kvwise.core.request import Request
from kvwise.core.request_hashes import RequestHashes


class KVCacheManager:
    """See the module docstring. ``windows``: each hybrid KV group's window (0: full
    attention; ``kv_spec.kv_groups``), group 0 first; ``(0,)``: one table for every layer."""

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
        windows: Sequence[int] = (0,),
        whole_hits: bool = False,
        breakpoints: BreakpointPolicy | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        if public_min_tokens < block_size:
            raise ValueError(
                f"public_min_tokens: must be at least block_size ({block_size}), "
                f"got {public_min_tokens}"
            )
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"windows: expected one or more windows >= 0, got {windows!r}")
        self.block_size = block_size
        self.windows = tuple(int(w) for w in windows)
        self.whole_hits = whole_hits and enable_caching and not any(self.windows)
        self.released: list[int] = []  # see take_released
        self.enable_caching = enable_caching
        self.model_fingerprint = model_fingerprint
        self.public_prefixes = [list(p) for p in public_prefixes]
        self.public_min_tokens = public_min_tokens
        kwargs = {} if clock is None else {"clock": clock}
        # KV events for cache-aware routers (take_kv_events); off: nothing is recorded
        self.events = KVEventLog(block_size) if kv_events else None
        kwargs.update(events=self.events, null_block=any(self.windows))
        self.pool = BlockPool(num_blocks, enable_caching, max_retained_blocks_per_tenant, **kwargs)
        # a windowed group's table points here where its blocks fell out of the window: a
        # block never freed, written or read (the kernels skip the blocks before the window)
        self.null_block = self.pool.null_block
        # one manager per KV group, by its kind of attention (core/kv_groups.py)
        self.groups = [make_group(self.pool, block_size, w) for w in self.windows]
        # cache breakpoints: keep runs, keeps at free, expiry at lookup (core/breakpoints.py)
        self.keeper = BreakpointKeeper(self.pool, block_size, breakpoints or BreakpointPolicy())
        self.req_to_blocks: dict[str, list[list[KVBlock]]] = {}  # one table per group
        # the hash chains (shared with routers: core/hashing.py); owns the public prefixes
        self.hasher = BlockHasher(
            model_fingerprint, block_size, self.public_prefixes, public_min_tokens
        )
        self.hashes = RequestHashes(self.hasher)  # each request's chains (request_hashes.py)
        # prefix-cache statistics, in tokens
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block apart)."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def add_public_prefix(self, token_ids: Sequence[int]) -> None:
        """Declare a prefix every tenant may share (in whole chunks of ``public_min_tokens``)."""
        self.public_prefixes.append(list(token_ids))

    def retain_cached(self, block_hashes: Sequence[BlockHash], tenant: str, seconds: float) -> int:
        """Keep the cached blocks of these (group 0) hashes, every group's copy, ``seconds``
        on ``tenant``'s account (a conversation waiting for a tool). Returns how many."""
        blocks = [
            b
            for b in map(
                self.pool.get_cached_block, self.hashes.every_group(block_hashes, self.num_groups)
            )
            if b is not None
        ]
        return self.pool.retain(blocks, tenant, self.pool.clock() + seconds)

    def drop_cached(self, block_hashes: Iterable[BlockHash]) -> int:
        """Forget the cached blocks with these (group 0) hashes, and every group's copy of
        them, where they are free (their KV is safe in a slower tier); blocks in use stay.
        Returns how many were dropped."""
        return self.pool.drop_cached(self.hashes.every_group(list(block_hashes), self.num_groups))

    def stats(self, running: Sequence[Request] = ()) -> KVCacheStats:
        """The pool now; ``running``: the live sequences whose utilisation to report."""
        pool = self.pool
        return KVCacheStats(
            blocks_total=self.num_blocks,
            blocks_used=pool.num_used_blocks,
            blocks_cached_free=pool.num_cached_free_blocks,
            blocks_free=pool.num_free_blocks,
            blocks_kept=sum(pool.num_retained.values()),
            prefix_query_tokens=self.num_prefix_query_tokens,
            prefix_hit_tokens=self.num_prefix_hit_tokens,
            breakpoint_expiries=self.keeper.num_expired,
            utilization=kv_utilization(
                running, self.req_to_blocks, self.null_block, self.block_size
            ),
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for(self, num_tokens: int, step_tokens: int) -> int:
        """Blocks of every group one sequence of ``num_tokens`` holds while computing its last
        ``step_tokens``."""
        return sum(group.blocks_held(num_tokens, step_tokens) for group in self.groups)

    def blocks_to_come(
        self, request: Request, step_tokens: int, hit: list[list[KVBlock]] | None = None
    ) -> int:
        """Blocks ``request`` will still take from the free ones to finish its prompt and write
        the next block of its answer, computing ``step_tokens`` at a time (``hit``: a waiting
        request's cached prefix, whose blocks other requests use take nothing)."""
        left = request.sampling_params.max_tokens - request.num_output_tokens
        target = max(request.num_tokens, request.num_prompt_tokens)
        need = self.blocks_for(target + max(0, min(self.block_size, left)), step_tokens)
        null = self.null_block
        if hit is not None:
            return need - sum(1 for t in hit for b in t if b is not null and b.ref_cnt > 0)
        held = sum(
            group.held(t, null)
            for t, group in zip(self.req_to_blocks.get(request.request_id, ()), self.groups)
        )
        return max(0, need - held)

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """Group ``group``'s block table of a request (the null block where a windowed group
        let blocks go)."""
        tables = self.req_to_blocks.get(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """The longest cached prefix of a new request: (each group's blocks, number of tokens
        they hold). A hit of n blocks needs every block of each full group and, of each
        windowed group, the blocks the next token's window reads (the others are the null
        block).

        Does not take references; pass the blocks to ``allocate_slots``.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.windows], 0  # (prompt logprobs: every row computed)
        self.hashes.extend(request, request.num_tokens)
        self.drop_cached(self.keeper.expire(request, request.block_hashes))  # ran out: not read
        tables = self._find_hit(request)
        self.num_prefix_query_tokens += request.num_tokens
        self.num_prefix_hit_tokens += len(tables[0]) * self.block_size
        return tables, len(tables[0]) * self.block_size

    def last_row_key(self, request: Request, end: int) -> BlockHash | None:
        """``ScheduledRequest.last_row_key`` of the chunk of ``request`` ending at ``end``:
        kept where a whole-prompt hit may later read it (``whole_hits``)."""
        n, lp = request.num_prompt_tokens, request.sampling_params.prompt_logprobs
        if end != n or n % self.block_size or lp is not None or not self.whole_hits:
            return None
        return self.hashes.last_row_key(request, n)

    def group_hashes(self, request: Request, group: int) -> list[BlockHash]:
        """``RequestHashes.of_group``: the hashes group ``group``'s blocks are cached under."""
        return self.hashes.of_group(request, group)

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a waiting request's prompt its pool holds now (a load estimate: counts
        nothing, takes nothing)."""
        if not self.enable_caching:
            return 0
        return len(self._find_hit(request)[0]) * self.block_size

    def _find_hit(self, request: Request) -> list[list[KVBlock]]:
        """Each group's table of the longest hit every group can serve: a full group's cached
        prefix bounds the hit; each windowed group then shortens it until the next token's
        window is cached (``kv_groups``)."""
        last = request.num_tokens if self.whole_hits else request.num_tokens - 1
        max_blocks = last // self.block_size
        if request.hit_limit_blocks is not None:  # a breakpoint's keep ran out there
            max_blocks = min(max_blocks, request.hit_limit_blocks)
        self.hashes.extend(request, max_blocks * self.block_size)
        get = self.pool.get_cached_block
        found: list[list[KVBlock | None]] = []
        n = max_blocks
        for g, group in enumerate(self.groups):
            found.append(group.found(self.group_hashes(request, g), n, get))
            n = group.longest_hit(found[g], n) if not group.window else n
        windowed = [(g, group) for g, group in enumerate(self.groups) if group.window]
        while windowed:  # windowed groups: the longest hit whose window is cached
            shorter = min(group.longest_hit(found[g], n) for g, group in windowed)
            if shorter == n:
                break
            n = shorter
        return [
            group.hit_table(found[g], n, self.null_block) for g, group in enumerate(self.groups)
        ]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVBlock]] | None = None,
        num_loaded_tokens: int = 0,
    ) -> list[list[int]] | None:
        """Make room for ``num_new_tokens`` after the computed ones (the first
        ``num_loaded_tokens`` of them are loaded from the tiers, not computed); a windowed
        group lets go of the blocks before its window.

        Returns the request's block table of each group (block ids), or None when the pool
        lacks free blocks (nothing is changed then).
        """
        tables = self.req_to_blocks.get(request.request_id)
        if tables is None:
            tables = [[] for _ in self.windows]
        if new_computed_blocks:
            tables = [t + n for t, n in zip(tables, new_computed_blocks, strict=True)]
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        computed = request.num_computed_tokens + num_hit * self.block_size
        num_required = self.blocks_needed(computed + num_new_tokens)
        num_old = len(tables[0]) - num_hit  # blocks it held before this call, per group
        # fresh blocks to take: each group's (its manager's count), and reviving a free cached
        # block also takes it out of the free queue
        wanted = sum(
            group.wanted(table, computed, num_loaded_tokens, num_required, num_old)
            for table, group in zip(tables, self.groups)
        )
        if new_computed_blocks:
            wanted += sum(1 for t in new_computed_blocks for b in t if b.ref_cnt == 0)
        if wanted > self.pool.num_free_blocks:
            return None
        null = self.null_block
        if new_computed_blocks:
            self.pool.touch(b for t in new_computed_blocks for b in t if b is not null)
        for table, group in zip(tables, self.groups):
            group.let_go(table, computed, self.released)  # before any group grows
        start = computed + num_loaded_tokens
        tables = [group.grow(t, start, num_required) for t, group in zip(tables, self.groups)]
        self.req_to_blocks[request.request_id] = tables
        return [[b.block_id for b in table] for table in tables]

    def cache_full_blocks(self, request: Request) -> None:
        """Record the request's computed full blocks in the prefix index (each group's under
        its own hashes)."""
        if not self.enable_caching:
            return
        self.hashes.extend(request, request.num_computed_tokens)
        num_full = request.num_computed_tokens // self.block_size
        tables = self.req_to_blocks.get(request.request_id)
        if not tables:
            return
        until = self.pool.clock() + request.retention_s if request.retention_s else None
        for g, blocks in enumerate(tables):
            first = self._first_held(blocks, num_full)
            hashes = self.group_hashes(request, g)
            self.pool.cache_blocks(blocks[:num_full], hashes[:num_full], first, events=g == 0)
            if until is not None:
                self.pool.retain(blocks[first:num_full], request.tenant, until)

    def first_held(self, request_id: str, group: int, num_blocks: int) -> int:
        """The first of a request's first ``num_blocks`` blocks group ``group`` holds (a
        windowed group holds none before its window)."""
        tables = self.req_to_blocks.get(request_id)
        return self._first_held(tables[group], num_blocks) if tables else 0

    def _first_held(self, blocks: list[KVBlock], num_blocks: int) -> int:
        first, end = 0, min(num_blocks, len(blocks))
        while first < end and blocks[first] is self.null_block:
            first += 1
        return first

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its head)."""
        tables = self.req_to_blocks.pop(request.request_id, None)
        if not tables:
            return
        self.keeper.keep(request, tables)  # its breakpoints' blocks, refreshed; its hit limit off
        null = self.null_block
        for blocks in tables:
            real = [b for b in blocks if b is not null]
            self.released.extend(b.block_id for b in real if b.block_hash is None)
            self.pool.free_blocks(reversed(real))

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
        null = self.null_block
        for tables in self.req_to_blocks.values():
            ids = [b.block_id for blocks in tables for b in blocks if b is not null]
            assert len(ids) == len(set(ids)), "a block appears twice in one request's tables"
            for block_id in ids:
                counts[block_id] += 1
        if null is not None:
            counts[null.block_id] = 1  # taken once, never freed
            assert null.block_hash is None, "the null block was cached"
        for block in self.pool.blocks:
            assert block.ref_cnt == counts[block.block_id], f"{block}: ref_cnt != tables holding it"
