"""Ordered tiers below the device pool: longest-prefix lookup, cost-model load plans, reads by
layer group, promotion on hit, background writes. Pure Python (payloads are buffers; the
worker turns them into tensors).

A *chunk* is ``chunk_blocks`` consecutive blocks of a sequence, aligned at multiples of
``chunk_blocks``; it is stored as ``layer_groups`` entries, one per run of layers, keyed by
``serde.entry_key(chain hash of its first block, group)``::

    blocks of a prompt:  | 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 |   (chunk_blocks = 4)
    chunks:              |  h0     |  h4     |  h8       | h12 (partial: the tail) |
    device prefix hit:   |<- 0..5 ->|
    load from tiers:          skip 4,5 of h4; then h8; then h12 ... while they match

A load happens in two halves. At admission, ``plan_load`` finds (one batched ``contains`` per
tier) how far the tiers continue the device hit and lets the cost model choose how much of
that to load; nothing is read yet. While the step runs, the engine reads the plan group by
group (``read_group``) on a loader thread and copies each group into the device pool as it
arrives, so the model's first layers run while later layers are still being read. Each entry
is checked (``serde.unpack``) and matched block by block against the prompt's own hashes; a
miss, a fault or a mismatch shortens the load, and the scheduler rolls the request back to
what was verified.

Writes are queued and run on one background thread: a write never blocks a step, and a full
queue drops the write (counted). A fault in any tier, or an entry that fails its checks, is
a miss: counted, logged once, the entry deleted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvwise.store import serde
from kvwise.store.base import FaultLog, KVStore
from kvwise.store.costmodel import CostModel, LoadDecision

logger = logging.getLogger("kvwise.store")

_MAX_KNOWN = 200_000  # chunk keys remembered as stored (to skip rewriting them)
_READ_PARTS = 4  # a tier's share of one read runs (and is checked) in this many parallel parts


@dataclass(frozen=True)
class PlannedChunk:
    """Part of one stored chunk to load into fresh device blocks."""

    first_block: int  # sequence index of the chunk's first block
    skip: int  # leading blocks of the chunk not to load (already on the device)
    num_blocks: int  # blocks to load after those
    block_hashes: tuple[bytes, ...]  # the prompt's hashes of blocks first .. first+skip+n
    tiers: tuple[str, ...]  # the tier each layer group is read from


@dataclass(frozen=True)
class LoadPlan:
    num_blocks: int  # blocks to load after the device prefix
    chunks: list[PlannedChunk]


@dataclass(frozen=True)
class GroupRead:
    """One layer group of one planned chunk, as read: ``usable`` leading blocks of the entry
    (counted from the chunk's first block) are verified and match the prompt."""

    payload: memoryview | None
    entry_blocks: int
    usable: int
    in_place: bool = False  # read straight into the device blocks ``dest`` gave


@dataclass(frozen=True)
class ChunkWrite:
    first_block: int
    block_hashes: tuple[bytes, ...]
    num_tiers: int | None = None  # write to the first this many tiers (None: all)

    @property
    def key(self) -> bytes:
        return self.block_hashes[0]


class TieredStore:
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
        self.block_size = fmt.block_size
        self.chunk_blocks = chunk_blocks
        self.min_tokens = min_tokens
        self.policy = policy
        self.cost = cost_model or CostModel()
        self.max_pending_bytes = max_pending_bytes
        # chunk key -> (last block hash, tiers above the one holding it, 0: every tier)
        self._known: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self._faults = {t.name: FaultLog(t.name, t.stats) for t in self.tiers}
        self.decisions: deque[LoadDecision] = deque(maxlen=1000)
        self.counters = {
            "load_decisions": 0,
            "recompute_decisions": 0,
            "loaded_tokens": 0,
            "chunks_written": 0,
            "writes_dropped": 0,
        }
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._pool = ThreadPoolExecutor(_READ_PARTS, thread_name_prefix="kvwise-kv-read")
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._writer, name="kvwise-kv-writer")
            self._thread.daemon = True
            self._thread.start()

    @property
    def layer_groups(self) -> int:
        return self.fmt.layer_groups

    def _keys(self, first_block_hash: bytes) -> list[bytes]:
        return [serde.entry_key(first_block_hash, g) for g in range(self.layer_groups)]

    # ---- load plans (engine thread, at admission) ---------------------------------------

    def plan_load(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_device_blocks: int,
        max_blocks: int,
        num_prompt_tokens: int,
    ) -> LoadPlan | None:
        """How much of the stored continuation of a device prefix hit to load (no reads yet).

        Args:
            block_hashes: the prompt's full-block chain hashes (at least ``max_blocks``).
            num_device_blocks: leading blocks already in the device pool.
            max_blocks: most blocks a hit may cover (the last prompt token is computed).
        """
        c, start = self.chunk_blocks, num_device_blocks
        if start >= max_blocks or not self.tiers or self.policy == "never":
            return None
        firsts = list(range(start // c * c, max_blocks, c))
        groups = self.layer_groups
        keys = [k for first in firsts for k in self._keys(block_hashes[first])]
        located = self._locate(keys)
        ends, chunk_tiers, sizes, per_tier = [], [], [], []
        for i, first in enumerate(firsts):
            tiers = located[i * groups : (i + 1) * groups]
            if any(t is None for t in tiers):
                break
            end = min(first + c, max_blocks)
            ends.append(end * self.block_size)
            chunk_tiers.append(tuple(t.name for t in tiers))
            # an entry holds at least the blocks this prompt would use from it
            sizes.append(
                sum(
                    serde.HEADER_SIZE + (end - first) * (32 + self.fmt.group_block_bytes(g))
                    for g in range(groups)
                )
            )
            per_tier.append(tiers[0].name)  # the cost model sees the chunk's first group's tier
        if not ends:
            return None
        bs, per_token = self.block_size, self.fmt.block_bytes / self.block_size
        if self.policy == "always":
            m, t_load, t_rec = len(ends), 0.0, self.cost.t_recompute(start * bs, ends[-1])
        else:
            m, t_load, t_rec = self.cost.choose(
                start * bs, ends, per_tier, sizes, per_token, num_prompt_tokens, groups
            )
        decision = LoadDecision(
            request_id, start * bs, ends[-1] - start * bs, ends[m - 1] - start * bs if m else 0,
            tuple(per_tier), t_load, t_rec,
        )  # fmt: skip
        self.decisions.append(decision)
        logger.debug("load decision: %s", decision)
        kind = "recompute_decisions" if decision.recomputed_instead else "load_decisions"
        self.counters[kind] += 1
        if m == 0:
            return None
        chunks = []
        for i in range(m):
            first = firsts[i]
            skip = max(start - first, 0)
            end = ends[i] // bs
            chunks.append(
                PlannedChunk(first, skip, end - first - skip, tuple(block_hashes[first:end]),
                             chunk_tiers[i])
            )  # fmt: skip
        return LoadPlan(ends[m - 1] // bs - start, chunks)

    def _locate(self, keys: list[bytes]) -> list[KVStore | None]:
        """The first tier holding each key (None: in no tier)."""
        located: list[KVStore | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, t in enumerate(located) if t is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([keys[i] for i in todo])):
                if present:
                    located[i] = tier
        return located

    # ---- reads (the engine's loader thread, while the step runs) ------------------------

    def read_group(
        self,
        chunks: Sequence[PlannedChunk],
        group: int,
        dest: Callable[[int, int], list] | None = None,
    ) -> list[GroupRead]:
        """Read and check one layer group of each planned chunk.

        ``dest(i, entry_blocks)``, when given, returns the payload buffers for chunk ``i``
        (``worker.kv_cache.payload_views``): tiers that can (disk) read straight into them.
        Never raises for a tier fault or a bad entry: that chunk's ``usable`` is 0 then (or
        short of ``skip + num_blocks`` when the entry stops matching the prompt).
        """
        keys = [serde.entry_key(ch.block_hashes[0], group) for ch in chunks]
        out = [GroupRead(None, 0, 0)] * len(chunks)
        for tier in self.tiers:
            idx = [i for i, ch in enumerate(chunks) if ch.tiers[group] == tier.name]
            if not idx:
                continue
            t0 = time.perf_counter()
            into = dest if dest is not None and getattr(tier, "reads_into", False) else None
            # NOTE: reads and checksums overlap across parts (file reads, socket reads and
            # zlib.crc32 all release the GIL)
            # a tier that reads in place gets one key per task, so that checking one entry
            # overlaps reading the next; others get a few batches (one round trip each)
            num_parts = len(idx) if into is not None else min(_READ_PARTS, len(idx))
            parts = [idx[p::num_parts] for p in range(num_parts)]
            results = self._pool.map(
                lambda part, t=tier, d=into: self._read(t, keys, part, group, d), parts
            )
            num_bytes = 0
            for part, got in zip(parts, results):
                for i, (nbytes, entry, value) in zip(part, got):
                    num_bytes += nbytes
                    out[i] = self._check(tier, keys[i], nbytes, entry, value, chunks[i], into)
            self.cost.observe_load(tier.name, len(idx), num_bytes, time.perf_counter() - t0)
        return out

    def _read(self, tier: KVStore, keys, part: list[int], group: int, into) -> list[tuple]:
        """Get and check entries: ``(bytes read, Entry | CorruptEntry | None, value)``."""
        if into is None:
            out: list[tuple] = []
            for i, value in zip(part, tier.get([keys[i] for i in part])):
                if value is None:
                    out.append((0, None, None))
                    continue
                try:
                    out.append((len(value), serde.unpack(self.fmt, keys[i], value), value))
                except serde.CorruptEntry as e:
                    out.append((len(value), e, value))
            return out

        def buffers_for(i: int):
            def make(num_bytes: int):
                num_blocks = serde.entry_blocks_from_size(self.fmt, group, num_bytes)
                if num_blocks is None:
                    return None
                return [bytearray(serde.HEADER_SIZE + 32 * num_blocks), *into(i, num_blocks)]

            return make

        got = tier.get([keys[i] for i in part], into=[buffers_for(i) for i in part])
        out = []
        for i, buffers in zip(part, got):
            if buffers is None:
                out.append((0, None, None))
            elif not isinstance(buffers, list):  # a size that is no whole entry
                out.append((0, serde.CorruptEntry("entry size"), None))
            else:
                nbytes = sum(memoryview(b).nbytes for b in buffers)
                try:
                    entry = serde.check_parts(self.fmt, keys[i], buffers[0], buffers[1:])
                    out.append((nbytes, entry, None))
                except serde.CorruptEntry as e:
                    out.append((nbytes, e, None))
        return out

    def _check(self, tier, key, nbytes, entry, value, chunk: PlannedChunk, into) -> GroupRead:
        if entry is None:
            return GroupRead(None, 0, 0)
        if isinstance(entry, serde.CorruptEntry) or entry.first_block != chunk.first_block:
            reason = entry if isinstance(entry, serde.CorruptEntry) else "misplaced chunk"
            self._faults[tier.name].fault("corrupt entry", reason)
            tier.delete([key])
            return GroupRead(None, 0, 0)
        limit = min(entry.num_blocks, len(chunk.block_hashes))
        usable = 0
        while usable < limit and entry.block_hashes[usable] == chunk.block_hashes[usable]:
            usable += 1
        tier_index = self.tiers.index(tier)
        if entry.group == 0:
            # a hit below the top tier is promoted: at once when we hold its bytes, else by
            # the request's own write when it finishes (to the tiers above this one only)
            promote_later = tier_index if value is None else 0
            self._remember(chunk.block_hashes[0], entry.block_hashes[-1], promote_later)
        if tier_index and value is not None:
            self._enqueue(("promote", tier_index, key, value), len(value))
        return GroupRead(entry.payload, entry.num_blocks, usable, in_place=value is None)

    def count_loaded(self, num_blocks: int) -> None:
        self.counters["loaded_tokens"] += num_blocks * self.block_size

    # ---- writes -------------------------------------------------------------------------

    def plan_writes(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> list[ChunkWrite]:
        """Chunks of a finished (or preempted) sequence that the tiers do not hold yet."""
        if not self.tiers or num_full_blocks * self.block_size < self.min_tokens:
            return []
        c, writes = self.chunk_blocks, []
        for first in range(0, num_full_blocks, c):
            hashes = tuple(block_hashes[first : min(first + c, num_full_blocks)])
            last, missing_above = self._known.get(hashes[0], (None, 0))
            if last == hashes[-1] and not missing_above:
                continue
            self._remember(hashes[0], hashes[-1])
            writes.append(ChunkWrite(first, hashes, missing_above if last == hashes[-1] else None))
        return writes

    def write(self, chunk: ChunkWrite, payload, ttl_s: float | None = None) -> None:
        """Queue one chunk's payload, all layers ``(num_layers, 2, num_blocks, ...)``, a buffer
        the caller no longer changes, for every tier (split into its layer groups)."""
        nbytes = memoryview(payload).nbytes
        if not self._enqueue(("write", chunk, payload, ttl_s), nbytes):
            self._known.pop(chunk.key, None)

    def _enqueue(self, item: tuple, nbytes: int) -> bool:
        with self._lock:
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.counters["writes_dropped"] += 1
                return False
            self._pending_bytes += nbytes
        if self._thread is None:
            self._run(item)
            self._done(nbytes)
        else:
            self._queue.put((item, nbytes))
        return True

    def _done(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                item, nbytes = job
                try:
                    self._run(item)
                except Exception:  # never let one bad write stop the writer
                    logger.exception("kv writer: unexpected error")
                self._done(nbytes)
            finally:
                self._queue.task_done()

    def _run(self, item: tuple) -> None:
        if item[0] == "write":
            _, chunk, payload, ttl_s = item
            view = memoryview(payload).cast("B")
            per_layer = len(chunk.block_hashes) * self.fmt.layer_block_bytes
            entries = []
            for g in range(self.layer_groups):
                first, count = self.fmt.group_layers(g)
                part = view[first * per_layer : (first + count) * per_layer]
                value = serde.pack(self.fmt, list(chunk.block_hashes), chunk.first_block, g, part)
                entries.append((serde.entry_key(chunk.key, g), value))
            for tier in self.tiers[: chunk.num_tiers]:
                tier.put(entries, ttl_s)
            self.counters["chunks_written"] += 1
        else:  # promote a hit from a lower tier into the tiers above it
            _, tier_index, key, value = item
            for tier in self.tiers[:tier_index]:
                tier.put([(key, bytes(value))])

    def _remember(self, key: bytes, last_hash: bytes, missing_above: int = 0) -> None:
        self._known[key] = (last_hash, missing_above)
        self._known.move_to_end(key)
        if len(self._known) > _MAX_KNOWN:
            self._known.popitem(last=False)

    # ---- sessions, lifecycle, stats -----------------------------------------------------

    def num_stored_blocks(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> int:
        """Leading blocks of a sequence that the tiers hold, every layer group (after
        ``flush``)."""
        c, groups, n = self.chunk_blocks, self.layer_groups, 0
        firsts = list(range(0, num_full_blocks, c))
        located = self._locate([k for f in firsts for k in self._keys(block_hashes[f])])
        for i, first in enumerate(firsts):
            if any(t is None for t in located[i * groups : (i + 1) * groups]):
                break
            n = min(first + c, num_full_blocks)
        return n

    def flush(self) -> None:
        """Wait until every queued write has reached the tiers."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Flush pending writes, stop the writer, close the tiers. Idempotent."""
        with self._lock:
            if self._closed:
                return
        self.flush()
        with self._lock:
            self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        self._pool.shutdown()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict:
        return {
            "tiers": {t.name: t.stats.as_dict() for t in self.tiers},
            **self.counters,
            "pending_write_bytes": self._pending_bytes,
        }
