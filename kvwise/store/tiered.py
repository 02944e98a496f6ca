"""``TieredStore``: the ordered tiers below the device pool, as the engine sees them. Pure
Python (payloads are buffers; the worker turns them into tensors).

A thin facade over three parts, each with its own contract:

- ``planner.ChunkPlanner``: ``plan_load`` (one batched ``contains`` per tier, the cost model,
  no reads), ``roll_back``, ``plan_writes``, ``plan_keeps``, ``num_stored_blocks``, the
  known-chunks map.
- ``reader.Reader``: ``read_group`` (parallel reads, checks, matching against the prompt, in
  place where the tier can), corrupt entries as faults, promotion of lower-tier hits.
- ``writer.Writer``: ``write``, ``keep`` and promotions on one background thread, a cap on the bytes
  queued (a write past it is dropped and counted), ``flush``.

It implements ``core.kv_tiers.KVTierPlanner`` for the scheduler (``plan_load``, ``roll_back``,
``plan_writes`` and ``plan_keeps`` are ``planner.ChunkPlanner``'s, bound in). A load happens in two
halves: at admission ``plan_load`` decides how much to load; while the step runs, the engine's
loader reads the plan group by group (``read_group``) and copies each group into the device
pool as it arrives, so the model's first layers run while later layers are still being read.
A miss, a fault or a mismatch shortens the load; the scheduler rolls the request back to what
was verified and calls ``roll_back``. Nothing here blocks a step on a write, and a fault in
any tier is a miss.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Sequence

from kvwise.core.kv_events import KVEvent
from kvwise.core.kv_tiers import ChunkWrite, LoadPlan, PlannedChunk
from kvwise.store import serde
from kvwise.store.base import KVStore
from kvwise.store.costmodel import CostCurves, CostModel, LoadDecision, cost_curves
from kvwise.store.planner import ChunkPlanner, other_groups_cost
from kvwise.store.reader import Dest, GroupRead, Reader
from kvwise.store.selftest import TierCheck, self_test
from kvwise.store.stats import StoreStats
from kvwise.store.tier_events import TierEvents
from kvwise.store.writer import ExtendKeeps, Promote, WriteChunk, Writer

__all__ = ["GroupRead", "TieredStore"]


class TieredStore:
    """The tiers (top first) as one store. See the module docstring.

    Args:
        tiers: the tiers, fastest first; hits below the top are promoted upwards.
        fmt: the entry format (KV layout, model, layer groups).
        chunk_blocks: blocks per stored chunk.
        min_tokens: sequences shorter than this are not written.
        policy: "auto" (the cost model decides), "always" or "never"; settable at run time.
        cost_model: the load-vs-recompute model (default: a fresh ``CostModel()``).
        max_pending_bytes: most bytes queued for the writer; writes past it are dropped.
        background: write on a thread (False: inside ``write``, for tests).
    """

    def __init__(
        self,
        tiers: Sequence[KVStore],
        fmt: serde.EntryFormat,
        chunk_blocks: int = 8,
        min_tokens: int = 64,
        policy: str = "auto",
        cost_model: CostModel | None = None,
        max_pending_bytes: int = 1 << 30,
        background: bool = True,
    ) -> None:
        self.tiers = list(tiers)
        self.fmt = fmt
        self.cost = cost_model or CostModel()
        self._planner = ChunkPlanner(self.tiers, fmt, self.cost, chunk_blocks, min_tokens, policy)
        # a chunk a tier failed to store is forgotten, so the next save of it writes it again
        self._writer = Writer(
            self.tiers, fmt, max_pending_bytes, background, on_lost=self._forget_chunk
        )
        self._reader = Reader(self.tiers, fmt, self._planner.known, self.cost, self._promote)
        # NOTE: KVTierPlanner (engine thread) is the planner's: its methods are bound here,
        # so their signatures and contract are written once (core/kv_tiers.py) and a plan
        # costs no extra call
        self.plan_span = self._planner.plan_span
        self.roll_back = self._planner.roll_back
        self.plan_writes = self._planner.plan_writes
        self.plan_keeps = self._planner.plan_keeps
        self._events: TierEvents | None = None  # record_events
        self._loaded_tokens = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def layer_groups(self) -> int:
        return self.fmt.layer_groups

    @property
    def block_size(self) -> int:
        return self.fmt.block_size

    @property
    def chunk_blocks(self) -> int:
        return self._planner.chunk_blocks

    @property
    def policy(self) -> str:
        return self._planner.policy

    @policy.setter
    def policy(self, policy: str) -> None:
        self._planner.policy = policy

    @property
    def decisions(self) -> deque[LoadDecision]:
        """The last 1000 load decisions, oldest first."""
        return self._planner.decisions

    def plan_load(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_device_blocks: int,
        max_blocks: int,
        num_prompt_tokens: int,
    ) -> LoadPlan | None:
        """``KVTierPlanner.plan_load``. A preempted request's blocks are written without
        delay (``write(soon=True)``); a plan waits for such writes still queued (bounded by
        the writer's stall limit), so the victim coming back loads them rather than missing
        entries that are a few milliseconds from the tiers."""
        self._writer.wait_soon()
        return self._planner.plan_load(
            request_id, block_hashes, num_device_blocks, max_blocks, num_prompt_tokens
        )

    # ---- loads (the engine's loader thread, while the step runs) ------------------------

    def read_group(
        self, chunks: Sequence[PlannedChunk], group: int, dest: Dest | None = None
    ) -> list[GroupRead]:
        """Read and check one layer group of each planned chunk (``reader.Reader``).

        ``dest(i, entry_blocks)``, when given, returns the payload buffers for chunk ``i``:
        tiers that read in place (disk) read straight into them. Never raises for a tier
        fault or a bad entry: that chunk's ``usable`` is 0 then (or short of
        ``num_blocks`` when the entry stops matching the prompt).
        """
        return self._reader.read_group(chunks, group, dest)

    def count_loaded(self, num_blocks: int, blocks_by_tier: dict[str, int] | None = None) -> None:
        """Count blocks a step really loaded (verified), for ``stats().loaded_tokens``, and
        ``blocks_by_tier`` (tier name -> blocks of those: a chunk by its first layer group's
        tier) in each tier's ``stats.loaded_tokens``."""
        self._loaded_tokens += num_blocks * self.block_size
        for tier in self.tiers:
            tier.stats.loaded_tokens += (blocks_by_tier or {}).get(tier.name, 0) * self.block_size

    def observe_step(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A model step ran over ``[(start_pos, num_tokens), ...]`` in ``seconds``."""
        self.cost.observe_step(chunks, seconds)

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        """Copying ``num_bytes`` read from the tiers into the device pool took ``seconds``."""
        self.cost.observe_copy(num_bytes, seconds)

    # ---- writes, sessions, lifecycle, stats ---------------------------------------------

    def write(
        self,
        chunk: ChunkWrite,
        payload,
        ttl_s: float | None = None,
        owner: str | None = None,
        soon: bool = False,
    ) -> None:
        """Queue one chunk's payload, all layers ``(num_layers, 2, num_blocks, ...)``, a buffer
        the caller no longer changes, for every tier (split into its layer groups); ``ttl_s``
        keeps it on ``owner``'s (the tenant's) account. ``soon``: it will be loaded back
        shortly (a preempted request's): written at once, not when the engine is idle."""
        if not self._writer.submit(WriteChunk(chunk, payload, ttl_s, owner, soon)):
            self._forget_chunk(chunk)  # dropped: a later sequence may write it

    def keep(self, chunks: Sequence[ChunkWrite], ttl_s: float, owner: str | None = None) -> None:
        """``KVTierPlanner.keep``: every layer group's entry of each chunk kept at least
        ``ttl_s`` from now where a tier holds it (``writer.ExtendKeeps``, queued)."""
        fmt = self.fmt
        keys = tuple(fmt.entry_key(c.key, g) for c in chunks for g in range(fmt.layer_groups))
        if keys and ttl_s > 0:
            self._writer.submit(ExtendKeeps(keys, ttl_s, owner))

    # ---- what each tier holds, as events (for cache-aware routers) ---------------------------

    def record_events(self) -> None:
        """From now on, record the chunks each tier that evicts on its own (host, disk) gains
        and loses (``tier_events.TierEvents``): ``take_tier_events``. Idempotent."""
        if self._events is None:
            self._events = TierEvents(self.tiers, self.block_size)
            self._writer.on_stored = self._events.stored

    def take_tier_events(self) -> list[KVEvent]:
        """``BlockStored`` / ``BlockRemoved`` (medium: the tier's name) since the last call;
        empty unless ``record_events`` was called."""
        return self._events.take() if self._events is not None else []

    def _forget_chunk(self, chunk: ChunkWrite) -> None:
        self._planner.known.forget(chunk.key)

    def _promote(self, tier_index: int, key: bytes, value: bytes) -> None:
        self._writer.submit(Promote(tier_index, key, value))

    def num_stored_blocks(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> int:
        """Leading blocks of a sequence that the tiers hold, every layer group (after
        ``flush``)."""
        return self._planner.num_stored_blocks(block_hashes, num_full_blocks)

    def flush(self) -> None:
        """Wait until every queued write has reached the tiers."""
        self._writer.flush()

    def engine_busy(self, busy: bool) -> None:
        """The step loop has work (True) or none (False): the writer yields to it
        (``writer.Writer.set_busy``)."""
        self._writer.set_busy(busy)

    def close(self) -> None:
        """Flush pending writes, stop the writer and the readers, close the tiers.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.close()
        self._reader.close()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> StoreStats:
        return StoreStats(
            load_decisions=self._planner.load_decisions,
            recompute_decisions=self._planner.recompute_decisions,
            lookup_misses=self._planner.lookup_misses,
            loaded_tokens=self._loaded_tokens,
            chunks_written=self._writer.chunks_written,
            writes_dropped=self._writer.writes_dropped,
            pending_write_bytes=self._writer.pending_bytes,
            tiers={t.name: t.stats.snapshot() for t in self.tiers},
            recomputed_tokens=self._planner.recomputed_tokens,
        )

    def self_test(self) -> list[TierCheck]:
        """Seal, write, read back, open and delete one entry in each tier (``selftest``); a
        failure is an error of that tier. For start-up, before any request."""
        return self_test(self.tiers, self.fmt)

    def cost_curves(self, max_tokens: int, num_points: int = 48) -> CostCurves:
        """The cost model's current fit as predicted TTFT against prefix length, per tier and
        for recomputing, with each tier's break-even (``costmodel.cost_curves``), for prompts
        up to ``max_tokens``. Reads the fits only: any thread may call it."""
        fmt = self.fmt

        def chunk_bytes(num_blocks: int) -> int:
            return sum(fmt.entry_bytes(g, num_blocks) for g in range(fmt.layer_groups))

        curves = cost_curves(
            self.cost,
            [t.name for t in self.tiers],
            fmt.block_size,
            self.chunk_blocks,
            max_tokens,
            chunk_bytes,
            fmt.layer_groups,
            fmt.block_bytes / fmt.block_size,
            num_points,
            extra=other_groups_cost(fmt, 0, self.chunk_blocks),
        )
        return dataclasses.replace(curves, policy=self.policy)
