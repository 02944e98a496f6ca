"""The disk tier: one file per entry under a directory, a byte budget, LRU, restart-safe.

Layout: ``<path>/<first 2 hex chars of key>/<64-hex key>.kv`` holds the entry bytes as given
(file names, reads and the start-up scan are ``disk_files``).

Contract (on top of ``base.KVStore``):
- Writes go to ``.<hex>.<pid>.<random>.tmp`` in the same directory, then ``os.replace``: a
  reader sees the old file, the new file or none, never a half-written one under the final
  name. No fsync: a crash can still leave a torn file, which the tag in ``serde``
  rejects (the tiered store's reader then ``delete``s it).
- Eviction as in ``index.LruIndex``: least recently used first; entries put with ``ttl_s``
  only after all others, until their time runs out; ``extend_keeps`` (``base.ExtendsKeeps``)
  keeps present entries longer (the index and the file's mtime). The budget counts file
  sizes.
- Restart: the index is rebuilt from the files. LRU order is the files' atime (set
  explicitly on every put and get hit, so it does not depend on mount options) and the keep
  time is the mtime (an mtime in the future means kept until then). Leftover ``*.tmp``
  files are deleted and a directory over budget is trimmed at start.
- One engine owns a directory at a time: it holds a ``flock`` on ``.kvwise.lock`` there from
  start to ``close`` (released by the kernel if the process dies). A second engine on the
  same directory fails at start with an error naming the owner's pid, before it looks at
  (or deletes) any file.
- ``contains`` answers from the in-memory index (no syscalls). ``get`` and ``get_into`` read
  the files in parallel on ``num_io_threads`` threads. A file gone behind the store's back is
  a miss; any other ``OSError`` (read or write, ENOSPC included) is a fault.
- ``get_into`` (``base.ReadsInPlace``) reads each file straight into the caller's buffers
  with ``preadv``: a load lands in the device pool with no intermediate copy.
- Thread safety: the index is under a lock; file data moves outside it. NOTE: the renames
  and unlinks that change which files exist are done under the lock, together with the
  index update, so the index and the directory agree whenever the lock is free.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvwise.store import disk_files
from kvwise.store.base import BuffersFor, EvictionReports, FaultLog
from kvwise.store.index import KeepLog, LruIndex, check_key, check_value, kept_cap
from kvwise.store.stats import TierStats
from kvwise.utils import format_bytes

if TYPE_CHECKING:
    from kvwise.config import StoreConfig


class DiskStore(EvictionReports):
    """Disk tier. ``DiskStore("/var/cache/kvwise", capacity_bytes=100 << 30)``.

    Args:
        path: directory of the entries (created if missing).
        capacity_bytes: budget for the files' bytes.
        num_io_threads: threads reading the files of one ``get`` in parallel.
        clock: seconds since the epoch; written into atime/mtime (injectable for tests).
    """

    name = "disk"
    load_prior = (1e-4, 2e-4, 1.2)  # the cost model's start: λ s, μ s per entry, s per GB

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        num_io_threads: int = 4,
        clock: Callable[[], float] = time.time,
        max_kept_fraction_per_tenant: float | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: expected >= 0, got {capacity_bytes}")
        if num_io_threads < 1:
            raise ValueError(f"num_io_threads: expected >= 1, got {num_io_threads}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._clock = clock
        self._faults = FaultLog(self.name, self.stats)
        self._index = LruIndex(kept_cap(capacity_bytes, max_kept_fraction_per_tenant))
        self._keeps = KeepLog(self.name, self.stats)
        self._lock = threading.Lock()
        self._closed = False
        self.path.mkdir(parents=True, exist_ok=True)
        self._root = str(self.path)
        self._lock_fd = disk_files.lock_directory(self._root)  # before any file is touched
        self._load_index()
        self._pool = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvwise-disk")

    def file_path(self, key: bytes) -> str:
        """Where ``key``'s entry lives (whether or not it is stored)."""
        return disk_files.entry_path(self._root, check_key(key))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        with self._lock:
            return [k in self._index for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        return self._get(keys, [None] * len(keys))

    def get_into(self, keys: Sequence[bytes], buffers_for: Sequence[BuffersFor]) -> list:
        """``base.ReadsInPlace.get_into``: each file read straight into the buffers
        ``buffers_for[i](file_size)`` returns.

        NOTE: this lets a load land in the device pool with no intermediate copy (and no
        fresh pages to fault in); the caller checks the bytes where they landed.
        """
        if len(buffers_for) != len(keys):
            raise ValueError(f"buffers_for: {len(buffers_for)} for {len(keys)} keys")
        return self._get(keys, list(buffers_for))

    def _get(self, keys: Sequence[bytes], readers: list[BuffersFor | None]) -> list:
        """Read the present keys in parallel (into ``readers[i]``'s buffers where given)."""
        keys = [check_key(k) for k in keys]
        out: list = [None] * len(keys)
        start = time.perf_counter()
        with self._lock:
            if self._closed:
                return out
            now = self._clock()
            present = [i for i, k in enumerate(keys) if self._index.touch(k, now)]
        paths = [self.file_path(keys[i]) for i in present]
        targets = [readers[i] for i in present]
        try:
            if len(paths) <= 1:
                results = [disk_files.read(p, now, t) for p, t in zip(paths, targets)]
            else:
                results = list(
                    self._pool.map(disk_files.read, paths, itertools.repeat(now), targets)
                )
        except RuntimeError:  # closed meanwhile: the pool takes no more work
            return out
        with self._lock:
            num_misses = len(keys) - len(present)
            for i, path, result in zip(present, paths, results):
                if isinstance(result, FileNotFoundError):
                    num_misses += 1
                    # NOTE: a put may have re-created the file since the read failed
                    if not os.path.exists(path):
                        self._index.remove(keys[i])
                elif isinstance(result, OSError):
                    self._faults.error("read", disk_files.error_kind("read", result), path, result)
                else:
                    out[i] = result
                    self.stats.hits += 1
                    self.stats.bytes_read += (
                        sum(memoryview(b).nbytes for b in result)
                        if isinstance(result, list)
                        else len(result)
                    )
            self.stats.misses += num_misses
            if any(v is not None for v in out):
                self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
            self._update_gauges()
        return out

    def put(
        self,
        items: Sequence[tuple[bytes, bytes]],
        ttl_s: float | None = None,
        owner: str | None = None,
    ) -> bool:
        items = [(check_key(k), v, check_value(v)) for k, v in items]
        stored = 0
        for key, value, num_bytes in items:
            if num_bytes > self.capacity_bytes:
                continue
            now = self._clock()
            wanted = now + ttl_s if ttl_s else 0.0
            with self._lock:
                if self._closed:
                    return False
                keep_until, keeper = self._index.keep_for(key, num_bytes, wanted, owner, now)
            path = self.file_path(key)
            tmp = self._write_tmp(path, value, now, keep_until)
            if tmp is None:
                continue
            with self._lock:
                if self._closed:
                    self._unlink(tmp)
                    return False
                try:
                    os.replace(tmp, path)
                except OSError as exc:
                    self._faults.error("write", disk_files.error_kind("write", exc), path, exc)
                    self._unlink(tmp)
                    continue
                self._index.remove(key)
                for victim in self._index.evict_for(num_bytes, self.capacity_bytes, now):
                    self._unlink(self.file_path(victim))
                    self.stats.evictions += 1
                    self._evicted(victim)
                kept = self._index.add(key, num_bytes, keep_until, now, keeper)
                if wanted > now and not kept:
                    self._keeps.refused(owner)
                self.stats.bytes_written += num_bytes
                self._update_gauges()
                stored += 1
        return stored == len(items)

    def extend_keeps(self, keys: Sequence[bytes], ttl_s: float, owner: str | None = None) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            if self._closed or ttl_s <= 0:
                return
            now = self._clock()
            for key in keys:
                before = self._index.keep_until(key)
                until = self._index.extend(key, now + ttl_s, owner, now)
                if until == 0.0:
                    self._keeps.refused(owner)
                elif until is not None and until != before:
                    self._set_keep_time(key, until)

    def _set_keep_time(self, key: bytes, until: float) -> None:
        """The file's mtime to ``until`` (its keep after a restart), its atime as it was.
        Call with the lock held."""
        path = self.file_path(key)
        try:
            atime_ns = os.stat(path).st_atime_ns
            os.utime(path, ns=(atime_ns, disk_files.ns(until)))
        except FileNotFoundError:
            pass  # gone behind the store's back: a miss at the next read
        except OSError as exc:
            self._faults.error("write", disk_files.error_kind("write", exc), path, exc)

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            if self._closed:
                return
            for key in keys:
                self._index.remove(key)
                self._unlink(self.file_path(key))  # even if unindexed: no orphan stays
            self._update_gauges()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index = LruIndex()
            self._update_gauges()
        self._pool.shutdown(wait=True)
        os.close(self._lock_fd)  # the directory is free for the next engine

    def local_secret(self) -> bytes:
        """This directory's own store secret (made on first use, mode 0600): the key secret
        when no other is configured, so its entries' names tell nothing about the prompts."""
        return disk_files.local_secret(self._root)

    def describe(self) -> str:
        with self._lock:
            num_entries = len(self._index)
        size = format_bytes(self.capacity_bytes)
        return f"disk {size} at {self._root} ({num_entries} entries found)"

    def eviction_order(self) -> list[bytes]:
        """Keys, first to be evicted first (for tests and debugging)."""
        with self._lock:
            return self._index.order()

    def drop_page_cache(self, keys: Sequence[bytes] | None = None) -> int:
        """Evict the given (default: all) entries from the OS page cache, so the next read is
        cold. For benchmarks; not part of ``KVStore``. Returns how many files were dropped."""
        if not hasattr(os, "posix_fadvise"):
            return 0
        with self._lock:
            keys = self._index.order() if keys is None else [check_key(k) for k in keys]
        num_files = 0
        for key in keys:
            try:
                fd = os.open(self.file_path(key), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                num_files += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return num_files

    def _write_tmp(self, path: str, value, now: float, keep_until: float) -> str | None:
        """Write ``value`` next to ``path`` under a temporary name; None on a fault."""
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name[:64]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            try:
                f = open(tmp, "xb")
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                f = open(tmp, "xb")
            with f:
                f.write(value)
            os.utime(tmp, ns=(disk_files.ns(now), disk_files.ns(keep_until or now)))
        except OSError as exc:
            with self._lock:
                self._faults.error("write", disk_files.error_kind("write", exc), path, exc)
                self._unlink(tmp)
            return None
        return tmp

    def _unlink(self, path: str) -> None:
        """Remove ``path`` if it exists; other errors are faults. Call with the lock held."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._faults.error("unlink", disk_files.error_kind("unlink", exc), path, exc)

    def _load_index(self) -> None:
        """Rebuild the index from the directory; drop temporaries; trim to the budget."""
        found, temporaries = disk_files.scan(self._root)
        for path in temporaries:
            self._unlink(path)
        now = self._clock()
        # NOTE: who kept an entry is not written down (it would link entries to tenants), so
        # the keeps found here share one account, capped as one tenant's: whatever a tenant
        # kept, after a restart it cannot hold more of the tier than that (least recently
        # used first: those past the cap are plain again)
        for f in found:
            self._index.add(f.key, f.num_bytes, f.mtime if f.mtime > now else 0.0, now)
        for victim in self._index.evict_for(0, self.capacity_bytes, now):
            self._unlink(self.file_path(victim))
            self.stats.evictions += 1
            self._evicted(victim)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.stats.num_entries = len(self._index)
        self.stats.num_bytes = self._index.num_bytes


def from_config(config: StoreConfig) -> DiskStore | None:
    """The disk tier ``kv_disk_path`` / ``kv_disk_size`` ask for; None when the path is off."""
    if not config.kv_disk_path:
        return None
    return DiskStore(
        config.kv_disk_path,
        config.kv_disk_size,
        max_kept_fraction_per_tenant=config.kv_max_kept_fraction_per_tenant,
    )
