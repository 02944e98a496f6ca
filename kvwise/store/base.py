"""The contract every KV tier implements: five batched methods and a stats record.

- Keys are 32-byte block-chain hashes (they already carry model, KV layout, tenant and salt,
  so isolation holds in every tier). Values are opaque bytes: a versioned header and the
  payload in one piece (``serde.pack``); a tier never interprets them.
- Every method takes a batch and never raises for a tier fault (I/O error, timeout, full
  disk, server down): ``get`` answers ``None`` for that key, ``contains`` ``False``, ``put``
  drops the entry. The fault is counted in ``stats.faults`` and logged once per kind. Only
  programming errors (wrong types) raise.
- ``get`` of a key refreshes its recency (LRU); ``put`` of an existing key replaces it.
- ``ttl_s`` on ``put``: keep the entry at least that long where the tier can (Redis: TTL of
  at least that; disk and host: evicted after every entry without one, until it expires).
- Thread safety: a tier may be called from the engine thread and the background writer at
  once; implementations lock what they share.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

logger = logging.getLogger("kvwise.store")


@dataclass
class TierStats:
    """Counters of one tier (monotonic, except the two gauges at the end)."""

    hits: int = 0  # keys found by get
    misses: int = 0  # keys get did not find (faults excluded)
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # wall time inside get
    loads: int = 0  # get calls that read something
    evictions: int = 0  # entries dropped to stay under the budget (or expired)
    faults: int = 0  # I/O errors, timeouts, corrupt entries: all served as misses
    num_entries: int = 0  # gauge
    num_bytes: int = 0  # gauge

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@runtime_checkable
class KVStore(Protocol):
    """One tier. ``name`` is "host", "disk" or "redis" (used in stats and metrics)."""

    name: str
    stats: TierStats

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present (a hint: an entry may vanish before ``get``)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The entries, ``None`` where missing or faulty."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None = None) -> None:
        """Store ``(key, entry)`` pairs; may evict others to stay under the budget."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drop keys (absent keys are ignored); used for corrupt entries."""
        ...

    def close(self) -> None:
        """Release files, connections and threads. Idempotent."""
        ...


class FaultLog:
    """Counts faults into ``stats`` and logs each kind once (then at debug level)."""

    def __init__(self, tier: str, stats: TierStats) -> None:
        self.tier = tier
        self.stats = stats
        self._seen: set[str] = set()

    def fault(self, kind: str, detail: object = "") -> None:
        self.stats.faults += 1
        level = logging.DEBUG if kind in self._seen else logging.WARNING
        self._seen.add(kind)
        logger.log(level, "kv tier %s: %s %s (served as a miss)", self.tier, kind, detail)
