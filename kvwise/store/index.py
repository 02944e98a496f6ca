"""Bookkeeping shared by the tiers: key and value checks, and ``LruIndex`` (keys, sizes and
keep times in eviction order). No I/O."""

from __future__ import annotations

import logging
from collections import OrderedDict

logger = logging.getLogger("kvwise.store")

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


class KeepLog:
    """Counts the keeps a tier refused (``stats.keeps_refused``) and logs the first of each
    tenant's, so an operator sees who is at the cap."""

    MAX_LOGGED = 10_000  # tenants remembered as logged; later ones log at debug level

    def __init__(self, tier: str, stats) -> None:
        self.tier = tier
        self.stats = stats
        self._logged: set[str | None] = set()

    def refused(self, owner: str | None) -> None:
        self.stats.keeps_refused += 1
        first = owner not in self._logged and len(self._logged) < self.MAX_LOGGED
        if first:
            self._logged.add(owner)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "kv tier %s: tenant %r is at its cap of kept bytes: its further entries are "
            "stored in plain LRU order (prompt_cache_retention not applied)",
            self.tier,
            owner,
        )


def kept_cap(capacity_bytes: int, fraction: float | None) -> int | None:
    """The kept bytes one keeper may hold in a tier of ``capacity_bytes`` (None: no cap)."""
    return None if fraction is None else int(capacity_bytes * fraction)


class LruIndex:
    """Keys with their sizes in eviction order; kept keys form a second, later queue.

    Not thread-safe: the tier that owns it locks. ``now`` comes from the tier's clock.

    ::

        plain: [oldest ... newest]   kept: [oldest ... newest]   (each key -> size)
                ^ evicted first            ^ evicted once plain is empty

    Each kept key is on a keeper's account (a tenant; None for keeps found on disk at start,
    whose keeper is not recorded): with ``max_kept_bytes_per_keeper``, a keeper whose kept
    bytes would pass it keeps no more, and its further keys go in the plain queue, so no
    tenant's retention can push another tenant's entries out of the tier.

    NOTE: expired kept keys are moved to the head of ``plain`` only when a victim is needed
    or a keeper is at its cap (a scan of ``kept``), so a put costs O(kept) once, not per victim.
    """

    def __init__(self, max_kept_bytes_per_keeper: int | None = None) -> None:
        self._plain: OrderedDict[bytes, int] = OrderedDict()
        # key -> (size, until, keeper)
        self._kept: OrderedDict[bytes, tuple[int, float, str | None]] = OrderedDict()
        self.max_kept_bytes_per_keeper = max_kept_bytes_per_keeper
        self.kept_bytes: dict[str | None, int] = {}  # keeper -> bytes of its kept keys
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._plain) + len(self._kept)

    def __contains__(self, key: bytes) -> bool:
        return key in self._plain or key in self._kept

    def keep_until(self, key: bytes) -> float:
        """When ``key``'s keep runs out (0.0: not kept or absent)."""
        kept = self._kept.get(key)
        return kept[1] if kept else 0.0

    def keep_for(
        self, key: bytes, num_bytes: int, keep_until: float, keeper: str | None, now: float
    ) -> tuple[float, str | None]:
        """The keep ``(until, keeper)`` a put of ``key`` asking for ``keep_until`` on
        ``keeper``'s account gets: an earlier keep of the key stays (another keeper's is not
        extended), and a keeper at its cap gets none (``(0.0, None)``: plain LRU)."""
        kept = self._kept.get(key)
        if kept is not None and kept[1] > now and (keep_until <= now or kept[2] != keeper):
            return kept[1], kept[2]
        if keep_until <= now:
            return 0.0, None
        until = max(keep_until, kept[1]) if kept is not None else keep_until
        replaced = kept[0] if kept is not None else 0  # its bytes are about to be replaced
        if not self._fits(keeper, num_bytes - replaced, now):
            return 0.0, None
        return until, keeper

    def extend(self, key: bytes, keep_until: float, keeper: str | None, now: float) -> float | None:
        """Keep a present ``key`` until at least ``keep_until``, as ``keep_for`` allows (not
        another keeper's live keep, nothing past the keeper's cap); a key that becomes kept
        moves to the end of the kept queue. Returns its keep time then (0.0: not kept) or
        None when absent."""
        num_bytes = self._plain.get(key)
        kept = self._kept.get(key)
        if num_bytes is None and kept is None:
            return None
        size = kept[0] if kept is not None else num_bytes
        until, keeper = self.keep_for(key, size, keep_until, keeper, now)
        if until <= now or (kept is not None and (until, keeper) == kept[1:]):
            return until
        self.remove(key)
        self._kept[key] = (size, until, keeper)
        self.kept_bytes[keeper] = self.kept_bytes.get(keeper, 0) + size
        self.num_bytes += size
        return until

    def order(self) -> list[bytes]:
        """All keys, first to be evicted first (expiry not applied)."""
        return [*self._plain, *self._kept]

    def add(
        self,
        key: bytes,
        num_bytes: int,
        keep_until: float,
        now: float,
        keeper: str | None = None,
    ) -> bool:
        """Insert or replace ``key`` as the most recently used; kept on ``keeper``'s account
        while ``keep_until > now`` unless that keeper is at its cap. Returns whether it is
        kept."""
        self.remove(key)
        kept = keep_until > now and self._fits(keeper, num_bytes, now)
        if kept:
            self._kept[key] = (num_bytes, keep_until, keeper)
            self.kept_bytes[keeper] = self.kept_bytes.get(keeper, 0) + num_bytes
        else:
            self._plain[key] = num_bytes
        self.num_bytes += num_bytes
        return kept

    def _fits(self, keeper: str | None, num_bytes: int, now: float) -> bool:
        cap = self.max_kept_bytes_per_keeper
        if cap is None or self.kept_bytes.get(keeper, 0) + num_bytes <= cap:
            return True
        self._expire(now)
        return self.kept_bytes.get(keeper, 0) + num_bytes <= cap

    def _expire(self, now: float) -> None:
        """Move expired kept keys to the head of ``plain``, oldest first."""
        expired = [key for key, (_, until, _) in self._kept.items() if until <= now]
        for key in reversed(expired):
            self._plain[key] = self._unkeep(key)
            self._plain.move_to_end(key, last=False)

    def _unkeep(self, key: bytes) -> int:
        num_bytes, _, keeper = self._kept.pop(key)
        self.kept_bytes[keeper] -= num_bytes
        if not self.kept_bytes[keeper]:
            del self.kept_bytes[keeper]
        return num_bytes

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
            self._plain[key] = self._unkeep(key)
        return True

    def remove(self, key: bytes) -> int | None:
        """Drop ``key``; its size, or None if absent."""
        num_bytes = self._plain.pop(key, None)
        if num_bytes is None:
            if key not in self._kept:
                return None
            num_bytes = self._unkeep(key)
        self.num_bytes -= num_bytes
        return num_bytes

    def evict_for(self, num_bytes: int, capacity_bytes: int, now: float) -> list[bytes]:
        """Remove and return victims until ``num_bytes`` more fit in ``capacity_bytes``."""
        if self.num_bytes + num_bytes <= capacity_bytes:
            return []
        self._expire(now)
        victims = []
        while self.num_bytes + num_bytes > capacity_bytes and len(self):
            queue = self._plain if self._plain else self._kept
            key = next(iter(queue))
            self.remove(key)
            victims.append(key)
        return victims
