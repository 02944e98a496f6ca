"""The host tier: entries in RAM under a byte budget, evicted least recently used first.

Contract (on top of ``base.KVStore``):
- The sum of entry sizes never exceeds ``capacity_bytes``; an entry bigger than the whole
  budget is not stored (and nothing is evicted for it).
- Eviction order: least recently used (``put`` or ``get`` hit) first, among the entries put
  without ``ttl_s``; entries put with ``ttl_s`` ("kept") go only after all of those. A kept
  entry whose time has run out becomes ordinary again, as the oldest of them (it is evicted
  first). Re-putting a kept entry never shortens its time, nor does ``extend_keeps``
  (``base.ExtendsKeeps``), which keeps present entries longer without rewriting them.
- Every method takes the one lock, so the engine thread and the background writer can call
  at once. Faults cannot happen here (RAM only), so ``stats.faults`` stays 0.

The bookkeeping (keys, sizes, keep times, order) is ``index.LruIndex``, shared with the disk
tier, which keeps its values in files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvwise.store.base import EvictionReports
from kvwise.store.index import KeepLog, LruIndex, check_key, check_value, kept_cap
from kvwise.store.stats import TierStats
from kvwise.utils import format_bytes

if TYPE_CHECKING:
    from kvwise.config import StoreConfig


class HostStore(EvictionReports):
    """RAM tier. ``HostStore(capacity_bytes=1 << 30)``.

    Args:
        capacity_bytes: budget for the entries' bytes (header and payload).
        max_kept_fraction_per_tenant: the share of the budget one tenant's kept (``ttl_s``)
            entries may take; past it, its entries are stored in plain LRU order (None: no
            cap).
        clock: seconds, for ``ttl_s`` (injectable for tests).
    """

    name = "host"
    load_prior = (2e-5, 2e-5, 0.4)  # the cost model's start: λ s, μ s per entry, s per GB

    def __init__(
        self,
        capacity_bytes: int,
        clock: Callable[[], float] = time.time,
        max_kept_fraction_per_tenant: float | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: expected >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._clock = clock
        self._index = LruIndex(kept_cap(capacity_bytes, max_kept_fraction_per_tenant))
        self._keeps = KeepLog(self.name, self.stats)
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

    def put(
        self,
        items: Sequence[tuple[bytes, bytes]],
        ttl_s: float | None = None,
        owner: str | None = None,
    ) -> bool:
        items = [(check_key(k), v, check_value(v)) for k, v in items]
        with self._lock:
            if self._closed:
                return False
            now = self._clock()
            keep_until = now + ttl_s if ttl_s else 0.0
            stored = 0
            for key, value, num_bytes in items:
                if num_bytes > self.capacity_bytes:
                    continue
                until, keeper = self._index.keep_for(key, num_bytes, keep_until, owner, now)
                # the old entry's bytes must not count against its replacement
                self._index.remove(key)
                for victim in self._index.evict_for(num_bytes, self.capacity_bytes, now):
                    del self._values[victim]
                    self.stats.evictions += 1
                    self._evicted(victim)
                kept = self._index.add(key, num_bytes, until, now, keeper)
                if keep_until > now and not kept:
                    self._keeps.refused(owner)
                # a bytearray is handed over (serde.pack's own buffer), other buffers copied
                self._values[key] = value if isinstance(value, (bytes, bytearray)) else bytes(value)
                self.stats.bytes_written += num_bytes
                stored += 1
            self._update_gauges()
        return stored == len(items)

    def extend_keeps(self, keys: Sequence[bytes], ttl_s: float, owner: str | None = None) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            if self._closed or ttl_s <= 0:
                return
            now = self._clock()
            for key in keys:
                if self._index.extend(key, now + ttl_s, owner, now) == 0.0:
                    self._keeps.refused(owner)
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

    def describe(self) -> str:
        return f"host {format_bytes(self.capacity_bytes)}"

    def eviction_order(self) -> list[bytes]:
        """Keys, first to be evicted first (for tests and debugging)."""
        with self._lock:
            return self._index.order()

    def _update_gauges(self) -> None:
        self.stats.num_entries = len(self._values)
        self.stats.num_bytes = self._index.num_bytes


def from_config(config: StoreConfig) -> HostStore | None:
    """The host tier ``kv_host_memory`` asks for; None when it is off (0)."""
    if not config.kv_host_memory:
        return None
    return HostStore(
        config.kv_host_memory,
        max_kept_fraction_per_tenant=config.kv_max_kept_fraction_per_tenant,
    )
