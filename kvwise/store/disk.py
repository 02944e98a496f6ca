"""The disk tier: one file per entry under a directory, a byte budget, LRU, restart-safe.

Layout: ``<path>/<first 2 hex chars of key>/<64-hex key>.kv`` holds the entry bytes as given.

Contract (on top of ``base.KVStore``):
- Writes go to ``.<hex>.<pid>.<random>.tmp`` in the same directory, then ``os.replace``: a
  reader sees the old file, the new file or none, never a half-written one under the final
  name. No fsync: a crash can still leave a torn file, which the header crc in ``serde``
  rejects (the tiered layer then ``delete``s it).
- Eviction as in ``host.LruIndex``: least recently used first; entries put with ``ttl_s``
  only after all others, until their time runs out. The budget counts file sizes.
- Restart: the index is rebuilt from the files. LRU order is the files' atime (set
  explicitly on every put and get hit, so it does not depend on mount options) and the keep
  time is the mtime (an mtime in the future means kept until then). Leftover ``*.tmp``
  files are deleted and a directory over budget is trimmed at start. One process owns a
  directory at a time.
- ``contains`` answers from the in-memory index (no syscalls). ``get`` reads the files in
  parallel on ``num_io_threads`` threads. A file gone behind the store's back is a miss;
  any other ``OSError`` (read or write, ENOSPC included) is a fault.
- Thread safety: the index is under a lock; file data moves outside it. NOTE: the renames
  and unlinks that change which files exist are done under the lock, together with the
  index update, so the index and the directory agree whenever the lock is free.
"""

from __future__ import annotations

import errno
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvwise.store.base import FaultLog, TierStats
from kvwise.store.index import LruIndex, check_key, check_value

_SUFFIX = ".kv"
_UTIME_FD = os.utime in os.supports_fd


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _preadv_all(fd: int, buffers: list) -> None:
    """Fill ``buffers`` in order from the start of the file (short reads continued; a file
    that ends early leaves the rest as it was, for the caller's checksum to catch)."""
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    i = 0
    while i < len(views):
        batch = views[i : i + 1024]  # IOV_MAX
        want = sum(v.nbytes for v in batch)
        got = os.preadv(fd, batch, offset)
        offset += got
        if got == want:
            i += len(batch)
            continue
        if got == 0:
            return
        # a short read: skip the buffers filled, resume inside the next one
        for j, v in enumerate(batch):
            if got < v.nbytes:
                views[i + j] = v[got:]
                i += j
                break
            got -= v.nbytes


def _kind(op: str, exc: OSError) -> str:
    return f"{op} {errno.errorcode.get(exc.errno or 0, type(exc).__name__)}"


class DiskStore:
    """Disk tier. ``DiskStore("/var/cache/kvwise", capacity_bytes=100 << 30)``.

    Args:
        path: directory of the entries (created if missing).
        capacity_bytes: budget for the files' bytes.
        num_io_threads: threads reading the files of one ``get`` in parallel.
        clock: seconds since the epoch; written into atime/mtime (injectable for tests).
    """

    name = "disk"
    reads_into = True  # get(keys, into=...) reads straight into the caller's buffers

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        num_io_threads: int = 4,
        clock: Callable[[], float] = time.time,
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
        self._index = LruIndex()
        self._lock = threading.Lock()
        self._closed = False
        self.path.mkdir(parents=True, exist_ok=True)
        self._root = str(self.path)
        self._load_index()
        self._pool = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvwise-disk")

    def file_path(self, key: bytes) -> str:
        """Where ``key``'s entry lives (whether or not it is stored)."""
        name = check_key(key).hex()
        return os.path.join(self._root, name[:2], name + _SUFFIX)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        with self._lock:
            return [k in self._index for k in keys]

    def get(self, keys: Sequence[bytes], into: Sequence[Callable] | None = None) -> list:
        """The entries (``bytearray``), or, with ``into``, read each file straight into the
        buffers ``into[i](file_size)`` returns (a list whose sizes add up to the file's; None
        when the size makes no sense: then nothing is read and an empty bytearray comes back,
        which the caller's checks reject). Returns those buffer lists then.

        NOTE: ``into`` lets a load land in the device pool with no intermediate copy (and no
        fresh pages to fault in); the caller checks the bytes where they landed.
        """
        keys = [check_key(k) for k in keys]
        readers = list(into) if into is not None else [None] * len(keys)
        out: list[bytes | bytearray | None] = [None] * len(keys)
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
                results = [self._read(p, now, t) for p, t in zip(paths, targets)]
            else:
                results = list(self._pool.map(self._read, paths, itertools.repeat(now), targets))
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
                    self._faults.fault(_kind("read", result), path)
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

    def put(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None = None) -> None:
        items = [(check_key(k), v, check_value(v)) for k, v in items]
        for key, value, num_bytes in items:
            if num_bytes > self.capacity_bytes:
                continue
            now = self._clock()
            with self._lock:
                if self._closed:
                    return
                keep_until = max(now + ttl_s if ttl_s else 0.0, self._index.keep_until(key))
            path = self.file_path(key)
            tmp = self._write_tmp(path, value, now, keep_until)
            if tmp is None:
                continue
            with self._lock:
                if self._closed:
                    self._unlink(tmp)
                    return
                try:
                    os.replace(tmp, path)
                except OSError as exc:
                    self._faults.fault(_kind("write", exc), path)
                    self._unlink(tmp)
                    continue
                self._index.remove(key)
                for victim in self._index.evict_for(num_bytes, self.capacity_bytes, now):
                    self._unlink(self.file_path(victim))
                    self.stats.evictions += 1
                self._index.add(key, num_bytes, keep_until, now)
                self.stats.bytes_written += num_bytes
                self._update_gauges()

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

    def _read(self, path: str, now: float, into: Callable | None = None):
        """The file's bytes (fewer if it shrank while read), or the buffers ``into`` gave
        (filled), or the error; refreshes atime."""
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if into is not None:
                    buffers = into(st.st_size)
                    if buffers is None:
                        return bytearray()
                    _preadv_all(f.fileno(), buffers)
                    result = buffers
                else:
                    buf = bytearray(st.st_size)
                    num_read = 0
                    with memoryview(buf) as view:
                        while num_read < len(buf):
                            n = f.readinto(view[num_read:])
                            if not n:
                                break
                            num_read += n
                    result = buf if num_read == len(buf) else buf[:num_read]
                target = f.fileno() if _UTIME_FD else path
                os.utime(target, ns=(_ns(now), st.st_mtime_ns))
        except OSError as exc:
            return exc
        return result

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
            os.utime(tmp, ns=(_ns(now), _ns(keep_until or now)))
        except OSError as exc:
            with self._lock:
                self._faults.fault(_kind("write", exc), path)
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
            self._faults.fault(_kind("unlink", exc), path)

    def _load_index(self) -> None:
        """Rebuild the index from the directory; drop temporaries; trim to the budget."""
        found = []  # (atime_ns, key, size, mtime)
        with os.scandir(self._root) as subs:
            subdirs = [s.path for s in subs if len(s.name) == 2 and s.is_dir(follow_symlinks=False)]
        for subdir in subdirs:
            with os.scandir(subdir) as entries:
                for entry in entries:
                    if entry.name.endswith(".tmp"):
                        self._unlink(entry.path)
                        continue
                    key = self._key_of(entry.name, os.path.basename(subdir))
                    if key is None:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_atime_ns, key, st.st_size, st.st_mtime_ns / 1e9))
        found.sort()
        now = self._clock()
        for _, key, size, mtime in found:
            self._index.add(key, size, mtime if mtime > now else 0.0, now)
        for victim in self._index.evict_for(0, self.capacity_bytes, now):
            self._unlink(self.file_path(victim))
            self.stats.evictions += 1
        self._update_gauges()

    @staticmethod
    def _key_of(name: str, subdir: str) -> bytes | None:
        """The key of a file this store wrote, from its name; None for any other file."""
        hex_key = name[:64]
        if len(name) != 64 + len(_SUFFIX) or not name.endswith(_SUFFIX):
            return None
        try:
            key = bytes.fromhex(hex_key)
        except ValueError:
            return None
        return key if key.hex() == hex_key and hex_key[:2] == subdir else None

    def _update_gauges(self) -> None:
        self.stats.num_entries = len(self._index)
        self.stats.num_bytes = self._index.num_bytes
