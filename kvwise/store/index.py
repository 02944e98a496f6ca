"""Bookkeeping shared by the tiers: key and value checks, and ``LruIndex`` (keys, sizes and
keep times in eviction order). No I/O."""

from __future__ import annotations

from collections import OrderedDict

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
