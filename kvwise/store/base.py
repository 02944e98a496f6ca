"""The contract every KV tier implements: a handful of batched methods and a stats record.

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
- A tier that can read an entry straight into the caller's buffers (no intermediate copy)
  also implements ``ReadsInPlace``; the tiered store checks with ``isinstance``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

logger = logging.getLogger("kvwise.store")


def _metric(name: str, help_text: str, kind: str = "counter", default: float = 0):
    """A stats field and the Prometheus series it is exposed as (counters get ``_total``
    appended on exposition, so ``name`` has none)."""
    return field(default=default, metadata={"metric": name, "help": help_text, "kind": kind})


@dataclass
class TierStats:
    """Counters of one tier (monotonic, except the two gauges at the end). Each field's
    ``metadata`` names its metric: ``metric``, ``help`` and ``kind`` ("counter" | "gauge")."""

    hits: int = _metric("kvwise_kv_tier_hits", "KV entries found in the tier")
    misses: int = _metric(  # faults excluded
        "kvwise_kv_tier_misses", "KV entries looked for and not found in the tier"
    )
    bytes_read: int = _metric("kvwise_kv_tier_read_bytes", "bytes read from the tier")
    bytes_written: int = _metric("kvwise_kv_tier_written_bytes", "bytes written to the tier")
    load_seconds: float = _metric(  # wall time inside get
        "kvwise_kv_tier_load_seconds", "seconds spent reading from the tier", default=0.0
    )
    loads: int = _metric(  # get calls that read something
        "kvwise_kv_tier_loads", "reads from the tier that returned entries"
    )
    evictions: int = _metric(
        "kvwise_kv_tier_evictions", "entries the tier dropped (budget or expiry)"
    )
    faults: int = _metric(
        "kvwise_kv_tier_faults", "I/O errors, timeouts and corrupt entries (as misses)"
    )
    loaded_tokens: int = _metric(  # counted by the store: a chunk by its first group's tier
        "kvwise_kv_tier_loaded_tokens", "prompt tokens loaded from the tier into the pool"
    )
    num_entries: int = _metric("kvwise_kv_tier_entries", "KV entries held by the tier", "gauge")
    num_bytes: int = _metric("kvwise_kv_tier_bytes", "bytes held by the tier", "gauge")

    def snapshot(self) -> TierStats:
        """A copy, unaffected by later updates."""
        return dataclasses.replace(self)


@runtime_checkable
class KVStore(Protocol):
    """One tier. ``name`` says which kind (e.g. "host"); it keys stats, metrics and plans."""

    name: str
    stats: TierStats

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present (a hint: an entry may vanish before ``get``)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The entries, ``None`` where missing or faulty."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None = None) -> bool:
        """Store ``(key, entry)`` pairs; may evict others to stay under the budget. Returns
        True when every pair was stored, False when any was not (a fault, an entry over the
        budget, a closed tier): the caller may write it again later."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drop keys (absent keys are ignored); used for corrupt entries."""
        ...

    def close(self) -> None:
        """Release files, connections and threads. Idempotent."""
        ...

    def describe(self) -> str:
        """One line for the start-up log, e.g. "host 2.0 GiB"."""
        ...


# given an entry's size in bytes, the buffers to read it into (None: no such entry size)
BuffersFor = Callable[[int], list | None]


@runtime_checkable
class ReadsInPlace(KVStore, Protocol):
    """A tier that reads entries straight into buffers the caller provides (disk: ``preadv``
    into the device pool), so a load needs no intermediate copy and the caller checks the
    bytes where they landed."""

    def get_into(self, keys: Sequence[bytes], buffers_for: Sequence[BuffersFor]) -> list:
        """Read each present key's entry into the buffers ``buffers_for[i]`` gives.

        ``buffers_for[i](num_bytes)`` is called at most once, possibly on another thread,
        with the stored entry's size, and only for a key that is present. It returns a list
        of writable buffers whose sizes add up to ``num_bytes`` (filled in order: the first
        bytes of the entry go into the first buffer), or ``None`` when no entry can have
        that size.

        Returns, per key: that list of buffers, filled (an entry that shrank while read
        leaves the rest as it was, for the caller's checksum to catch); ``None`` for a
        miss or a fault; ``[]`` when ``buffers_for`` returned ``None`` (nothing was read; a
        hit in the stats, with 0 bytes read).
        """
        ...


class EvictionReports:
    """Mixin of a tier that evicts on its own (host, disk): each victim's key goes to
    ``on_evict``, set by whoever tracks what the tier holds (None: nobody does)."""

    on_evict: Callable[[bytes], None] | None = None

    def _evicted(self, key: bytes) -> None:
        if self.on_evict is not None:
            self.on_evict(key)


class FaultLog:
    """Counts faults into ``stats`` and logs each kind once (then at debug level)."""

    def __init__(self, tier: str, stats: TierStats) -> None:
        self.tier = tier
        self.stats = stats
        self._seen: set[str] = set()

    def corrupt(self, detail: object = "") -> None:
        """An entry the tier returned (and counted as a hit) failed its checks: it is a
        fault, not a hit."""
        self.stats.hits -= 1
        self.fault("corrupt entry", detail)

    def fault(self, kind: str, detail: object = "") -> None:
        self.stats.faults += 1
        level = logging.DEBUG if kind in self._seen else logging.WARNING
        self._seen.add(kind)
        logger.log(level, "kv tier %s: %s %s (served as a miss)", self.tier, kind, detail)
