"""The tiers' start-up self-test: each tier seals, writes, reads back and opens one entry of
the engine's own format, then deletes it. Pure Python.

``kvwise serve`` runs it once before it serves and logs one line, so a tier that cannot store
or load (a full disk, a Redis that refuses writes, a library that changed under us) is seen at
start-up, not after hours of recomputed prompts. A failure is an error of that tier
(``health.TierHealth``: counted, logged with its traceback, shown by /health as degraded);
the server starts all the same, since every tier's fault is a miss. The test entry is real
traffic: it counts in the tier's stats (one write, one read).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from kvwise.store import serde
from kvwise.store.base import FaultLog, KVStore, ReadsInPlace, error_count, guarded

logger = logging.getLogger("kvwise.store")


@dataclass(frozen=True)
class TierCheck:
    """One tier's self-test: ``error`` is None when it passed."""

    tier: str
    seconds: float
    error: str | None = None

    def __str__(self) -> str:
        if self.error is None:
            return f"{self.tier} ok ({self.seconds * 1e3:.1f} ms)"
        return f"{self.tier} FAILED ({self.error})"


def self_test(tiers: list[KVStore], fmt: serde.EntryFormat) -> list[TierCheck]:
    """Seal, write, read back, open and delete one one-block entry in each tier, in order."""
    return [_check(tier, fmt) for tier in tiers]


def summary(checks: list[TierCheck]) -> str:
    """The start-up log line."""
    return "KV tier self-test: " + (", ".join(map(str, checks)) or "no tiers")


def log_self_test(store) -> list[TierCheck]:
    """Run ``store.self_test()`` (a ``TieredStore``) and log its line: info when every tier
    passed, a warning when one failed (its error is logged with its traceback besides)."""
    checks = store.self_test()
    failed = any(c.error is not None for c in checks)
    (logger.warning if failed else logger.info)("%s", summary(checks))
    return checks


def _check(tier: KVStore, fmt: serde.EntryFormat) -> TierCheck:
    faults = FaultLog(tier.name, tier.stats)
    start = time.perf_counter()
    block_hash = os.urandom(32)  # no prompt's: nothing real is overwritten or found
    key = fmt.entry_key(block_hash, 0)
    payload = os.urandom(fmt.group_block_bytes(0))
    try:
        value = serde.pack(fmt, [block_hash], 0, 0, payload)
    except Exception as exc:  # sealing is the engine's, not a tier's: say so, count nothing
        return TierCheck(tier.name, time.perf_counter() - start, f"seal: {exc!r}")
    errors_before = error_count(tier.stats)
    if not guarded(faults, "put", tier.put, [(key, value)], miss=False):
        return _failed(tier, faults, start, errors_before, "write", "the entry was not stored")
    got, error = _read_back(tier, fmt, faults, key)
    guarded(faults, "delete", tier.delete, [key], miss=None)
    if error is None and got != payload:
        error = "read back other bytes than were written"
    if error is not None:
        return _failed(tier, faults, start, errors_before, "read", error)
    return TierCheck(tier.name, time.perf_counter() - start)


def _read_back(
    tier: KVStore, fmt: serde.EntryFormat, faults: FaultLog, key: bytes
) -> tuple[bytes | None, str | None]:
    """The entry's payload as the engine reads it (in place where the tier can), or why not."""
    try:
        if isinstance(tier, ReadsInPlace):
            payload = bytearray(fmt.group_block_bytes(0))
            parts = [bytearray(fmt.head_bytes(1)), payload, bytearray(serde.TAG_SIZE)]
            (got,) = guarded(
                faults, "get_into", tier.get_into, [key], [lambda n: parts], miss=[None]
            )
            if not got:
                return None, "the entry written was not found"
            serde.open_parts(fmt, key, got)
            return bytes(payload), None
        (value,) = guarded(faults, "get", tier.get, [key], miss=[None])
        if value is None:
            return None, "the entry written was not found"
        return bytes(serde.unpack(fmt, key, value).payload), None
    except Exception as exc:  # a corrupt entry or a bug in opening it: the test failed
        faults.exception("open", exc)
        return None, f"{type(exc).__name__}: {exc}"


def _failed(tier, faults: FaultLog, start: float, errors_before: int, op: str, why: str):
    """A failed check; an error of ``op`` unless the tier already counted one."""
    if error_count(tier.stats) == errors_before:
        faults.error(op, f"self-test: {why}")
    return TierCheck(tier.name, time.perf_counter() - start, f"{op}: {why}")
