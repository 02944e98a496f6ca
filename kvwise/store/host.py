"""The host tier: entries in RAM under a byte budget, evicted least recently used first.

Contract (on top of ``base.KVStore``):
- The sum of entry sizes never exceeds ``capacity_bytes``; an entry bigger than the whole
  budget is not stored (and nothing is evicted for it).
- Eviction order: least recently used (``put`` or ``get`` hit) first, among the entries put
  without ``ttl_s``; entries put with ``ttl_s`` ("kept") go only after all of those. A kept
  entry whose time has run out becomes ordinary again, as the oldest of them (it is evicted
  first). Re-putting a kept entry never shortens its time.
- Every method takes the one lock, so the engine thread and the background writer can call
  at once. Faults cannot happen here (RAM only), so ``stats.faults`` stays 0.

``LruIndex`` is the bookkeeping alone (keys, sizes, keep times, order), shared with the disk
tier, which keeps its values in files.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvwise.store.base import TierStats

KEY_SIZE = 32


def check_key(key: object) -> bytes:
    """``key`` if it is a 32-byte ``bytes``; a ``ValueError`` naming it otherwise."""
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        detail = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ValueError(f"key: expected {KEY_SIZE} bytes (a block hash), got {detail}")
    return key


def check_value(value: object) -> int:
    """Size in bytes of a bytes-like ``value``; a ``ValueError`` naming it otherwise."""
    try:
        return memoryview(value).nbytes  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"value: expected bytes-like, got {type(value).__name__}") from None


class LruIndex:
    """Keys with their sizes in eviction order; kept keys form a second, later queue.

    Not thread-safe: the owner locks. ``now`` comes from the owner's clock.

    ::

        plain: [oldest ... newest]   kept: [oldest ... newest]   (each key -> size)
                ^ evicted first            ^ evicted once plain is empty

    NOTE: expired kept keys are moved to the head of ``plain`` only when a victim is needed
    (a scan of ``kept``), so a put that evicts costs O(kept) once, not per victim.
    """

    def __init__(self) -> None:
        self._plain: OrderedDict[bytes, int] = OrderedDict()
        self._kept: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # (size, until)
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._plain) + len(self._kept)

    def __contains__(self, key: bytes) -> bool:
        return key in self._plain or key in self._kept

    def keep_until(self, key: bytes) -> float:
        """When ``key``'s keep runs out (0.0: not kept or absent)."""
        kept = self._kept.get(key)
        return kept[1] if kept else 0.0

    def order(self) -> list[bytes]:
        """All keys, first to be evicted first (expiry not applied)."""
        return [*self._plain, *self._kept]

    def add(self, key: bytes, num_bytes: int, keep_until: float, now: float) -> None:
        """Insert or replace ``key`` as the most recently used; kept while ``keep_until > now``."""
        self.remove(key)
        if keep_until > now:
            self._kept[key] = (num_bytes, keep_until)
        else:
            self._plain[key] = num_bytes
        self.num_bytes += num_bytes

    def touch(self, key: bytes, now: float) -> bool:
        """Mark ``key`` most recently used; False if absent."""
        if key in self._plain:
            self._plain.move_to_end(key)
            return True
        kept = self._kept.get(key)
        if kept is None:
            return False
        if kept[1] > now:
            self._kept.move_to_end(key)
        else:
            del self._kept[key]
            self._plain[key] = kept[0]
        return True

    def remove(self, key: bytes) -> int | None:
        """Drop ``key``; its size, or None if absent."""
        num_bytes = self._plain.pop(key, None)
        if num_bytes is None:
            kept = self._kept.pop(key, None)
            if kept is None:
                return None
            num_bytes = kept[0]
        self.num_bytes -= num_bytes
        return num_bytes

    def evict_for(self, num_bytes: int, capacity_bytes: int, now: float) -> list[bytes]:
        """Remove and return victims until ``num_bytes`` more fit in ``capacity_bytes``."""
        if self.num_bytes + num_bytes <= capacity_bytes:
            return []
        expired = [key for key, (_, until) in self._kept.items() if until <= now]
        for key in reversed(expired):  # oldest ends up first
            self._plain[key] = self._kept.pop(key)[0]
            self._plain.move_to_end(key, last=False)
        victims = []
        while self.num_bytes + num_bytes > capacity_bytes and len(self):
            queue = self._plain if self._plain else self._kept
            key = next(iter(queue))
            self.remove(key)
            victims.append(key)
        return victims


class HostStore:
    """RAM tier. ``HostStore(capacity_bytes=1 << 30)``.

    Args:
        capacity_bytes: budget for the entries' bytes (header and payload).
        clock: seconds, for ``ttl_s`` (injectable for tests).
    """

    name = "host"

    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.time) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: expected >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._clock = clock
        self._index = LruIndex()
        self._values: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        with self._lock:
            return [k in self._values for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = [check_key(k) for k in keys]
        start = time.perf_counter()
        with self._lock:
            now = self._clock()
            out = [self._values.get(k) if self._index.touch(k, now) else None for k in keys]
            if self._closed:
                return out
            num_hits = sum(v is not None for v in out)
            self.stats.hits += num_hits
            self.stats.misses += len(keys) - num_hits
            self.stats.bytes_read += sum(len(v) for v in out if v is not None)
            if num_hits:
                self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None = None) -> None:
        items = [(check_key(k), v, check_value(v)) for k, v in items]
        with self._lock:
            if self._closed:
                return
            now = self._clock()
            keep_until = now + ttl_s if ttl_s else 0.0
            for key, value, num_bytes in items:
                if num_bytes > self.capacity_bytes:
                    continue
                # the old entry's bytes must not count against its replacement
                keep = max(keep_until, self._index.keep_until(key))
                self._index.remove(key)
                for victim in self._index.evict_for(num_bytes, self.capacity_bytes, now):
                    del self._values[victim]
                    self.stats.evictions += 1
                self._index.add(key, num_bytes, keep, now)
                self._values[key] = value if isinstance(value, bytes) else bytes(value)
                self.stats.bytes_written += num_bytes
            self._update_gauges()

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            for key in keys:
                if self._index.remove(key) is not None:
                    del self._values[key]
            self._update_gauges()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._index = LruIndex()
            self._values.clear()
            self._update_gauges()

    def eviction_order(self) -> list[bytes]:
        """Keys, first to be evicted first (for tests and debugging)."""
        with self._lock:
            return self._index.order()

    def _update_gauges(self) -> None:
        self.stats.num_entries = len(self._values)
        self.stats.num_bytes = self._index.num_bytes
