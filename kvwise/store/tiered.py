"""Ordered tiers below the device pool: longest-prefix lookup, cost-model loads, promotion on
hit, background writes. Pure Python (payloads are buffers; the worker turns them into
tensors).

Entries cover ``chunk_blocks`` consecutive blocks of a sequence, aligned at multiples of
``chunk_blocks`` and keyed by the chain hash of their first block (``serde``)::

    blocks of a prompt:  | 0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 |   (chunk_blocks = 4)
    entries:             |  key h0 |  key h4 |  key h8   | key h12 (partial: the tail) |
    device prefix hit:   |<- 0..5 ->|
    load from tiers:          skip 4,5 of h4; then h8; then h12 ... while they match

Loads run in the engine thread, synchronously, at admission (the cost model keeps them
cheaper than recomputing). Writes are queued and run on one background thread: a write
never blocks a step, and a full queue drops the write (counted). A fault in any tier, or an
entry that fails its checks, is a miss: counted, logged once, the entry deleted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvwise.store import serde
from kvwise.store.base import FaultLog, KVStore
from kvwise.store.costmodel import CostModel, LoadDecision

logger = logging.getLogger("kvwise.store")

_MAX_KNOWN = 200_000  # chunk keys remembered as stored (to skip rewriting them)
_READ_GROUPS = 4  # a load reads (and checks) its entries in this many parallel groups


@dataclass(frozen=True)
class ChunkLoad:
    """Part of one stored entry to copy into fresh device blocks."""

    first_block: int  # sequence index of the entry's first block
    skip: int  # leading blocks of the entry not to copy (already on the device)
    num_blocks: int  # blocks to copy after those
    entry_blocks: int  # blocks in the payload
    payload: memoryview  # (num_layers, 2, entry_blocks, block_size, kv_heads, head_dim)
    tier: str


@dataclass(frozen=True)
class PrefixLoad:
    num_blocks: int  # blocks loaded after the device prefix
    chunks: list[ChunkLoad]
    seconds: float  # time spent reading and checking


@dataclass(frozen=True)
class ChunkWrite:
    first_block: int
    block_hashes: tuple[bytes, ...]

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
        self._known: OrderedDict[bytes, bytes] = OrderedDict()  # key -> last block hash
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
        self._pool = ThreadPoolExecutor(_READ_GROUPS, thread_name_prefix="kvwise-kv-read")
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._writer, name="kvwise-kv-writer")
            self._thread.daemon = True
            self._thread.start()

    # ---- loads (engine thread) ----------------------------------------------------------

    def load_prefix(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_device_blocks: int,
        max_blocks: int,
        num_prompt_tokens: int,
    ) -> PrefixLoad | None:
        """Read the stored continuation of a device prefix hit, if loading beats recomputing.

        Args:
            block_hashes: the prompt's full-block chain hashes (at least ``max_blocks``).
            num_device_blocks: leading blocks already in the device pool.
            max_blocks: most blocks a hit may cover (the last prompt token is computed).
        """
        c, start = self.chunk_blocks, num_device_blocks
        if start >= max_blocks or not self.tiers or self.policy == "never":
            return None
        keys = [block_hashes[j * c] for j in range(start // c, -(-max_blocks // c))]
        located = self._locate(keys)
        ends, tiers, sizes = [], [], []
        for j, tier in zip(range(start // c, start // c + len(keys)), located):
            if tier is None:
                break
            end_block = min((j + 1) * c, max_blocks)
            ends.append(end_block * self.block_size)
            tiers.append(tier.name)
            # an entry holds at least the blocks this prompt would use from it
            sizes.append(serde.HEADER_SIZE + (end_block - j * c) * (32 + self.fmt.block_bytes))
        if not ends:
            return None
        bs, per_token = self.block_size, self.fmt.block_bytes / self.block_size
        if self.policy == "always":
            m, t_load, t_rec = len(ends), 0.0, self.cost.t_recompute(start * bs, ends[-1])
        else:
            m, t_load, t_rec = self.cost.choose(
                start * bs, ends, tiers, sizes, per_token, num_prompt_tokens
            )
        decision = LoadDecision(
            request_id, start * bs, ends[-1] - start * bs, ends[m - 1] - start * bs if m else 0,
            tuple(tiers), t_load, t_rec,
        )  # fmt: skip
        self.decisions.append(decision)
        self.counters[
            "recompute_decisions" if decision.recomputed_instead else "load_decisions"
        ] += 1
        if m == 0:
            return None
        return self._fetch(keys[:m], located[:m], block_hashes, start, max_blocks)

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

    def _fetch(self, keys, located, block_hashes, start: int, max_blocks: int) -> PrefixLoad | None:
        t0 = time.perf_counter()
        read: list[tuple[bytes | None, serde.Entry | serde.CorruptEntry | None]]
        read = [(None, None)] * len(keys)
        for tier in self.tiers:
            idx = [i for i, t in enumerate(located) if t is tier]
            if not idx:
                continue
            t1 = time.perf_counter()
            # NOTE: reads and checksums overlap across groups (file reads, socket reads and
            # zlib.crc32 all release the GIL): a cold 2,048-token disk read + check went
            # from ~112 ms in series to the time of the read alone.
            groups = [idx[g::_READ_GROUPS] for g in range(min(_READ_GROUPS, len(idx)))]
            results = self._pool.map(
                lambda g, tier=tier: self._read(tier, [keys[i] for i in g]), groups
            )
            nbytes = 0
            for group, got in zip(groups, results):
                for i, (value, entry) in zip(group, got):
                    read[i] = (value, entry)
                    nbytes += len(value) if value is not None else 0
            self.cost.observe_load(tier.name, len(idx), nbytes, time.perf_counter() - t1)
        c, chunks, pos = self.chunk_blocks, [], start
        promote: list[tuple[int, bytes, bytes]] = []
        for i, (key, (value, entry), tier) in enumerate(zip(keys, read, located)):
            if value is None:
                break
            if isinstance(entry, serde.CorruptEntry):
                self._faults[tier.name].fault("corrupt entry", entry)
                tier.delete([key])
                break
            first = (start // c + i) * c
            if entry.first_block != first:
                self._faults[tier.name].fault("corrupt entry", "misplaced chunk")
                tier.delete([key])
                break
            skip = pos - first
            limit = min(entry.num_blocks, max_blocks - first)
            usable = skip
            while usable < limit and entry.block_hashes[usable] == block_hashes[first + usable]:
                usable += 1
            if usable > skip:
                chunks.append(
                    ChunkLoad(
                        first, skip, usable - skip, entry.num_blocks, entry.payload, tier.name
                    )
                )
                pos = first + usable
            self._remember(key, entry.block_hashes[-1])
            if tier is not self.tiers[0]:
                promote.append((self.tiers.index(tier), key, value))
            if usable < min(c, max_blocks - first):
                break  # the entry stops matching (or ends) inside this chunk
        for tier_index, key, value in promote:
            self._enqueue(("promote", tier_index, key, value), len(value))
        seconds = time.perf_counter() - t0
        num_blocks = pos - start
        if not num_blocks:
            return None
        self.counters["loaded_tokens"] += num_blocks * self.block_size
        return PrefixLoad(num_blocks, chunks, seconds)

    def _read(self, tier: KVStore, keys: list[bytes]) -> list[tuple]:
        """Get and check entries: ``(value, Entry | CorruptEntry | None)`` per key."""
        out: list[tuple] = []
        for key, value in zip(keys, tier.get(keys)):
            if value is None:
                out.append((None, None))
                continue
            try:
                out.append((value, serde.unpack(self.fmt, key, value)))
            except serde.CorruptEntry as e:
                out.append((value, e))
        return out

    # ---- writes -------------------------------------------------------------------------

    def plan_writes(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> list[ChunkWrite]:
        """Chunks of a finished (or preempted) sequence that the tiers do not hold yet."""
        if not self.tiers or num_full_blocks * self.block_size < self.min_tokens:
            return []
        c, writes = self.chunk_blocks, []
        for first in range(0, num_full_blocks, c):
            hashes = tuple(block_hashes[first : min(first + c, num_full_blocks)])
            if self._known.get(hashes[0]) == hashes[-1]:
                continue
            self._remember(hashes[0], hashes[-1])
            writes.append(ChunkWrite(first, hashes))
        return writes

    def write(self, chunk: ChunkWrite, payload, ttl_s: float | None = None) -> None:
        """Queue one chunk's payload (a buffer the caller no longer changes) for every tier."""
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
            value = serde.pack(self.fmt, list(chunk.block_hashes), chunk.first_block, payload)
            for tier in self.tiers:
                tier.put([(chunk.key, value)], ttl_s)
            self.counters["chunks_written"] += 1
        else:  # promote a hit from a lower tier into the tiers above it
            _, tier_index, key, value = item
            for tier in self.tiers[:tier_index]:
                tier.put([(key, bytes(value))])

    def _remember(self, key: bytes, last_hash: bytes) -> None:
        self._known[key] = last_hash
        self._known.move_to_end(key)
        if len(self._known) > _MAX_KNOWN:
            self._known.popitem(last=False)

    # ---- sessions, lifecycle, stats -----------------------------------------------------

    def num_stored_blocks(self, block_hashes: Sequence[bytes], num_full_blocks: int) -> int:
        """Leading blocks of a sequence that some tier holds (after ``flush``)."""
        c = self.chunk_blocks
        keys = [block_hashes[first] for first in range(0, num_full_blocks, c)]
        located = self._locate(keys)
        n = 0
        for first, tier in zip(range(0, num_full_blocks, c), located):
            if tier is None:
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
