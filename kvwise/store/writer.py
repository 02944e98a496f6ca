"""Writes to the tiers, off the engine thread: one background writer thread and its queue.

Contract:
- ``submit(job)`` never blocks on I/O and never raises for a tier fault. It queues the job
  and returns True, or drops it and returns False (counted in ``writes_dropped``) when the
  writer is closed or the job's bytes would take the bytes queued past
  ``max_pending_bytes``.
- Three kinds of job, run in the order submitted:
  - ``WriteChunk``: one chunk's payload, all layers ``(num_layers, 2, num_blocks, ...)``,
    split into its layer groups, each packed as one entry (``serde.pack``) and put, with
    ``ttl_s``, to the first ``chunk.num_tiers`` tiers (all by default). Counted in
    ``chunks_written``. A chunk some tier did not store (a fault: Redis down, disk full)
    is handed to ``on_lost``, so that it is written again the next time it is saved.
  - ``Promote``: an entry read from a lower tier, put unchanged into the tiers above it.
  - ``ExtendKeeps``: entries the tiers hold kept at least ``ttl_s`` from now, in every tier
    that can (``base.ExtendsKeeps``); nothing is rewritten.
- ``pending_bytes``: bytes of the submitted jobs not yet finished (a gauge).
- Whatever a tier raises in ``put`` is a fault of that tier (``base.guarded``): the entry is
  not stored there, the chunk handed to ``on_lost``.
- ``flush()`` returns once every job submitted before it has finished, or once the writer
  has finished no job for ``stall_s`` (a job puts to each tier once, each put bounded by the
  tier's deadline: ``base.call_deadline``; a tier stuck past it is logged, and flush returns
  False instead of waiting for ever, so ``park`` and ``close`` never hang on a tier).
  ``close()`` flushes, then stops the thread (idempotent; later submits are dropped; a thread
  stuck in a tier is left behind, a daemon). The tiers are the caller's to close.
- The step loop comes first: while the engine says it is busy (``set_busy``) the thread
  starts no job, nor until it has been idle ``quiet_s`` (a request sent right after another
  finished does not share the CPU with that one's writes), unless the job has waited
  ``max_defer_s`` (under steady load writes still land) or a ``flush`` waits for it. A job
  that has started runs to its end. A ``soon`` job (a preempted request's blocks, which it
  loads back when it returns) is never held, nor are the jobs queued before it;
  ``wait_soon()`` returns once no such job is queued (or after ``stall_s``).
- ``background=False`` runs each job inside ``submit`` (tests, deterministic); an error of
  the writer's own (packing) then reaches the caller. On the thread it is logged and the
  job skipped: one bad job never stops the writer.

NOTE: a job's payload is a buffer the caller no longer changes; the writer holds it, not a
copy, until the job has run.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvwise.core.kv_tiers import ChunkWrite
from kvwise.store import serde
from kvwise.store.base import ExtendsKeeps, FaultLog, KVStore, call_deadline, guarded

logger = logging.getLogger("kvwise.store")

_STALL_MARGIN_S = 1.0  # packing a job, on top of its puts' deadlines


@dataclass(frozen=True)
class WriteChunk:
    """Store one chunk (every layer group) in the tiers ``chunk.num_tiers`` names."""

    chunk: ChunkWrite
    payload: object  # buffer: (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
    ttl_s: float | None = None
    owner: str | None = None  # the tenant whose retention ``ttl_s`` is
    soon: bool = False  # to be loaded back shortly: not held for an idle engine

    @property
    def num_bytes(self) -> int:
        return memoryview(self.payload).nbytes


@dataclass(frozen=True)
class Promote:
    """Copy an entry found in tier ``tier_index`` into the tiers above it."""

    tier_index: int
    key: bytes
    value: bytes | bytearray | memoryview  # the entry as read (header and payload)

    @property
    def num_bytes(self) -> int:
        return memoryview(self.value).nbytes


@dataclass(frozen=True)
class ExtendKeeps:
    """Keep the entries ``keys`` (where a tier holds them) at least ``ttl_s`` from now, on
    ``owner``'s account."""

    keys: tuple[bytes, ...]
    ttl_s: float
    owner: str | None = None
    num_bytes = 0  # nothing to write


WriteJob = WriteChunk | Promote | ExtendKeeps


class Writer:
    """The background writer of a ``TieredStore``.

    Args:
        tiers: the tiers, top first.
        fmt: the entry format chunks are packed in.
        max_pending_bytes: most bytes queued at once; a job past it is dropped.
        background: run jobs on a thread (False: inside ``submit``).
        on_lost: called (on the writer's thread) with each chunk a tier failed to store.
        quiet_s: how long the engine must have been idle before a job starts.
        max_defer_s: the longest a job waits for that.
    """

    def __init__(
        self,
        tiers: Sequence[KVStore],
        fmt: serde.EntryFormat,
        max_pending_bytes: int = 1 << 30,
        background: bool = True,
        on_lost: Callable[[ChunkWrite], None] | None = None,
        quiet_s: float = 0.05,
        max_defer_s: float = 2.0,
    ) -> None:
        self.tiers = list(tiers)
        self.fmt = fmt
        self.on_lost = on_lost
        # called (on the writer's thread) with (tier name, entry keys, the chunk's block hashes)
        # for each tier a chunk landed in; None: nobody asked (TieredStore.record_events)
        self.on_stored: Callable[[str, list[bytes], list[bytes]], None] | None = None
        self.max_pending_bytes = max_pending_bytes
        # how long flush waits for the next job to finish before it gives up on the writer
        self.stall_s = sum(call_deadline(t) for t in self.tiers) + _STALL_MARGIN_S
        self.chunks_written = 0
        self.writes_dropped = 0
        self._pending_bytes = 0
        self._faults = [FaultLog(t.name, t.stats) for t in self.tiers]  # by tier index
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # a job finished
        self._num_queued = 0  # jobs queued so far (the thread's), and finished
        self._num_finished = 0
        self._closed = False
        self.quiet_s, self.max_defer_s = quiet_s, max_defer_s
        self._busy = False  # the engine's step loop has work (set_busy)
        self._idle_since = time.monotonic()
        self._flushing = 0  # flushes waiting: jobs start at once
        self._soon = 0  # ``soon`` jobs queued and not finished: jobs start at once
        self._quiet = threading.Condition(self._lock)  # busy, idle or a flush changed
        self._queue: queue.Queue[tuple[WriteJob, float] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="kvwise-kv-writer")
            self._thread.daemon = True
            self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def set_busy(self, busy: bool) -> None:
        """The engine's step loop has work (True) or has none (False): see the contract."""
        with self._lock:
            if busy == self._busy:
                return
            self._busy = busy
            if not busy:
                self._idle_since = time.monotonic()
            self._quiet.notify_all()

    def _wait_for_quiet(self, submitted: float) -> None:
        """Hold the next job while the step loop needs the CPU (see the contract)."""
        with self._lock:
            while not (self._closed or self._flushing or self._soon):
                now = time.monotonic()
                waited = now - submitted
                if waited >= self.max_defer_s:
                    return
                idle = 0.0 if self._busy else now - self._idle_since
                if idle >= self.quiet_s:
                    return
                left = self.max_defer_s - waited
                self._quiet.wait(left if self._busy else min(left, self.quiet_s - idle))

    def submit(self, job: WriteJob) -> bool:
        """Queue ``job`` (run it now without a thread). False: dropped, and counted."""
        num_bytes = job.num_bytes
        with self._lock:
            if self._closed or self._pending_bytes + num_bytes > self.max_pending_bytes:
                self.writes_dropped += 1
                return False
            self._pending_bytes += num_bytes
            if self._thread is not None:
                if isinstance(job, WriteChunk) and job.soon:
                    self._soon += 1
                    self._quiet.notify_all()
                self._num_queued += 1
                # under the lock: queued in the order counted
                self._queue.put((job, time.monotonic()))
        if self._thread is None:
            self._run(job)
        return True

    def flush(self) -> bool:
        """Wait until every job submitted so far has reached the tiers. False: the writer
        finished no job for ``stall_s`` (stuck in a tier; logged), so this stopped waiting."""
        with self._lock:
            target = self._num_queued
            self._flushing += 1
            self._quiet.notify_all()
            try:
                while self._num_finished < target:
                    if self._thread is None or not self._thread.is_alive():
                        return True
                    seen = self._num_finished
                    if not self._done.wait_for(lambda s=seen: self._num_finished > s, self.stall_s):
                        logger.warning(
                            "kv writer: no write finished for %.1f s (a tier stuck past its "
                            "deadline?): not waiting for the %d queued",
                            self.stall_s,
                            target - self._num_finished,
                        )
                        return False
            finally:
                self._flushing -= 1
        return True

    def wait_soon(self) -> bool:
        """Wait until no ``soon`` job is queued. False: none finished for ``stall_s``."""
        with self._lock:
            while self._soon and self._thread is not None and self._thread.is_alive():
                seen = self._num_finished
                if not self._done.wait_for(
                    lambda s=seen: not self._soon or self._num_finished > s, self.stall_s
                ):
                    return False
        return True

    def close(self) -> None:
        """Flush, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
        flushed = self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._quiet.notify_all()
        if self._thread is not None:
            self._queue.put(None)
            if flushed:  # else it is stuck in a tier: left behind (a daemon)
                self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, submitted = item
            self._wait_for_quiet(submitted)
            try:
                self._run(job)
            except Exception:  # never let one bad write stop the writer
                logger.exception("kv writer: unexpected error")
            finally:
                with self._lock:
                    self._num_finished += 1
                    self._done.notify_all()

    def _run(self, job: WriteJob) -> None:
        try:
            if isinstance(job, WriteChunk):
                self._write_chunk(job)
            elif isinstance(job, ExtendKeeps):
                self._extend_keeps(job)
            else:
                for index in range(job.tier_index):
                    self._put(index, [(job.key, bytes(job.value))])
        finally:
            with self._lock:
                self._pending_bytes -= job.num_bytes
                if self._thread is not None and isinstance(job, WriteChunk) and job.soon:
                    self._soon -= 1
                    self._done.notify_all()

    def _write_chunk(self, job: WriteChunk) -> None:
        chunk = job.chunk
        view = memoryview(job.payload).cast("B")
        hashes = list(chunk.block_hashes)
        entries, offset = [], 0
        # the layer groups tile the layers in order, so their payloads follow one another
        for g in range(self.fmt.layer_groups):
            end = offset + len(hashes) * self.fmt.group_block_bytes(g)
            value = serde.pack(self.fmt, hashes, chunk.first_block, g, view[offset:end])
            entries.append((self.fmt.entry_key(chunk.key, g), value))
            offset = end
        # NOTE: every tier is tried (no short cut): each stores what it can
        num_tiers = len(self.tiers[: chunk.num_tiers])
        stored = [self._put(i, entries, job.ttl_s, job.owner) for i in range(num_tiers)]
        if self.on_stored is not None:
            keys = [key for key, _ in entries]
            for tier, ok in zip(self.tiers, stored):
                if ok:
                    self.on_stored(tier.name, keys, hashes)
        self.chunks_written += 1
        if not all(stored) and self.on_lost is not None:
            self.on_lost(chunk)

    def _extend_keeps(self, job: ExtendKeeps) -> None:
        for tier, faults in zip(self.tiers, self._faults):
            if isinstance(tier, ExtendsKeeps):
                extend = tier.extend_keeps
                guarded(faults, "extend_keeps", extend, job.keys, job.ttl_s, job.owner, miss=None)

    def _put(
        self, index: int, entries: list, ttl_s: float | None = None, owner: str | None = None
    ) -> bool:
        """Tier ``index``'s ``put``; False: not all stored (a fault, whatever it raised
        included)."""
        put, faults = self.tiers[index].put, self._faults[index]
        # NOTE: ``owner`` only when there is one: a tier that keeps no per-owner share need
        # not take it
        args = (entries, ttl_s) if owner is None else (entries, ttl_s, owner)
        return guarded(faults, "put", put, *args, miss=False) is not False
