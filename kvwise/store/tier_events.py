"""What the tiers below the pool gain and lose, as the KV events of ``core/kv_events.py``
(``BlockStored`` / ``BlockRemoved``, medium: the tier's name), for cache-aware routers. Pure
Python.

Contract:
- Only tiers that evict on their own and say so (``base.ReportsEvictions``: host, disk) are
  tracked; a shared tier (Redis, whose entries expire unseen and which other engines write)
  is not, since this process cannot know what it holds.
- Events go by *chunk* (the run of blocks one entry holds, every layer group of it): a chunk
  is stored when the writer lands it in a tracked tier (``stored``, the writer's
  ``on_stored``) and removed when the first of its layer groups is evicted there
  (``evicted``): once, however many groups follow.
- Chunks promoted from a lower tier and those a tier held before tracking began are not
  reported (their evictions neither).
- ``stored`` runs on the writer's thread, ``evicted`` on whichever thread made the tier
  evict, ``take`` on the engine's: one lock.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

from kvwise.core.kv_events import BlockRemoved, BlockStored, KVEvent
from kvwise.store.base import KVStore, ReportsEvictions


class TierEvents:
    """Tracks the chunks each tier that reports evictions holds, from now on, as events.

    Args:
        tiers: the store's tiers; each ``ReportsEvictions`` one gets its ``on_evict`` set.
        block_size: tokens per block, for ``BlockStored``.
    """

    def __init__(self, tiers: Sequence[KVStore], block_size: int) -> None:
        self.block_size = block_size
        self._tracked = {t.name for t in tiers if isinstance(t, ReportsEvictions)}
        self._events: list[KVEvent] = []
        self._held: dict[tuple[str, bytes], tuple[bytes, ...]] = {}  # (tier, entry key) -> chunk
        self._chunks: set[tuple[str, tuple[bytes, ...]]] = set()  # chunks a tier holds whole
        self._lock = threading.Lock()
        for tier in tiers:
            if isinstance(tier, ReportsEvictions):
                tier.on_evict = functools.partial(self.evicted, tier.name)

    def stored(self, tier: str, keys: list[bytes], hashes: list[bytes]) -> None:
        """A chunk (its block hashes) landed in ``tier`` under entry ``keys`` (one per layer
        group)."""
        if tier not in self._tracked:
            return
        chunk = tuple(hashes)
        with self._lock:
            for key in keys:
                self._held[(tier, key)] = chunk
            self._chunks.add((tier, chunk))
            self._events.append(BlockStored(list(chunk), None, self.block_size, tier))

    def evicted(self, tier: str, key: bytes) -> None:
        """``tier`` dropped the entry ``key``."""
        with self._lock:
            chunk = self._held.pop((tier, key), None)
            if chunk is not None and (tier, chunk) in self._chunks:  # its first group to go
                self._chunks.discard((tier, chunk))
                self._events.append(BlockRemoved(list(chunk), tier))

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events
