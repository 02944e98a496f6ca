"""Writes to the tiers, off the engine thread: one background writer thread and its queue.

Contract:
- ``submit(job)`` never blocks on I/O and never raises for a tier fault. It queues the job
  and returns True, or drops it and returns False (counted in ``writes_dropped``) when the
  writer is closed or the job's bytes would take the bytes queued past
  ``max_pending_bytes``.
- Two kinds of job, run in the order submitted:
  - ``WriteChunk``: one chunk's payload, all layers ``(num_layers, 2, num_blocks, ...)``,
    split into its layer groups, each packed as one entry (``serde.pack``) and put, with
    ``ttl_s``, to the first ``chunk.num_tiers`` tiers (all by default). Counted in
    ``chunks_written``. A chunk some tier did not store (a fault: Redis down, disk full)
    is handed to ``on_lost``, so that it is written again the next time it is saved.
  - ``Promote``: an entry read from a lower tier, put unchanged into the tiers above it.
- ``pending_bytes``: bytes of the submitted jobs not yet finished (a gauge).
- ``flush()`` returns once every job submitted before it has finished; ``close()`` flushes,
  then stops the thread (idempotent; later submits are dropped). The tiers are the caller's
  to close.
- ``background=False`` runs each job inside ``submit`` (tests, deterministic); an error in a
  job then reaches the caller. On the thread it is logged and the job skipped: one bad job
  never stops the writer.

NOTE: a job's payload is a buffer the caller no longer changes; the writer holds it, not a
copy, until the job has run.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvwise.core.kv_tiers import ChunkWrite
from kvwise.store import serde
from kvwise.store.base import KVStore

logger = logging.getLogger("kvwise.store")


@dataclass(frozen=True)
class WriteChunk:
    """Store one chunk (every layer group) in the tiers ``chunk.num_tiers`` names."""

    chunk: ChunkWrite
    payload: object  # buffer: (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
    ttl_s: float | None = None

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


WriteJob = WriteChunk | Promote


class Writer:
    """The background writer of a ``TieredStore``.

    Args:
        tiers: the tiers, top first.
        fmt: the entry format chunks are packed in.
        max_pending_bytes: most bytes queued at once; a job past it is dropped.
        background: run jobs on a thread (False: inside ``submit``).
        on_lost: called (on the writer's thread) with each chunk a tier failed to store.
    """

    def __init__(
        self,
        tiers: Sequence[KVStore],
        fmt: serde.EntryFormat,
        max_pending_bytes: int = 1 << 30,
        background: bool = True,
        on_lost: Callable[[ChunkWrite], None] | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.fmt = fmt
        self.on_lost = on_lost
        # called (on the writer's thread) with (tier name, entry keys, the chunk's block hashes)
        # for each tier a chunk landed in; None: nobody asked (TieredStore.record_events)
        self.on_stored: Callable[[str, list[bytes], list[bytes]], None] | None = None
        self.max_pending_bytes = max_pending_bytes
        self.chunks_written = 0
        self.writes_dropped = 0
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="kvwise-kv-writer")
            self._thread.daemon = True
            self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def submit(self, job: WriteJob) -> bool:
        """Queue ``job`` (run it now without a thread). False: dropped, and counted."""
        num_bytes = job.num_bytes
        with self._lock:
            if self._closed or self._pending_bytes + num_bytes > self.max_pending_bytes:
                self.writes_dropped += 1
                return False
            self._pending_bytes += num_bytes
        if self._thread is None:
            self._run(job)
        else:
            self._queue.put(job)
        return True

    def flush(self) -> None:
        """Wait until every job submitted so far has reached the tiers."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Flush, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
        self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                try:
                    self._run(job)
                except Exception:  # never let one bad write stop the writer
                    logger.exception("kv writer: unexpected error")
            finally:
                self._queue.task_done()

    def _run(self, job: WriteJob) -> None:
        try:
            if isinstance(job, WriteChunk):
                self._write_chunk(job)
            else:
                for tier in self.tiers[: job.tier_index]:
                    tier.put([(job.key, bytes(job.value))])
        finally:
            with self._lock:
                self._pending_bytes -= job.num_bytes

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
        stored = [
            tier.put(entries, job.ttl_s) is not False for tier in self.tiers[: chunk.num_tiers]
        ]
        if self.on_stored is not None:
            keys = [key for key, _ in entries]
            for tier, ok in zip(self.tiers, stored):
                if ok:
                    self.on_stored(tier.name, keys, hashes)
        self.chunks_written += 1
        if not all(stored) and self.on_lost is not None:
            self.on_lost(chunk)
