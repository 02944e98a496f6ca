"""The store's stats: ``TierStats`` (one tier's counters, live) and ``StoreStats`` (the store's
counters at one moment, with a snapshot of each tier's). Pure Python.

Each field that is exposed names its metric in its metadata (``core.stat_fields.metric``):
``/metrics`` shows a ``TierStats`` field as one series per tier (label ``tier``) and a
``StoreStats`` field as one series; ``core.stat_fields.metric_fields`` lists them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvwise.core.stat_fields import GAUGE, metric
from kvwise.store.health import TierHealth

_ERRORS = "kvwise_tier_errors"
_ERRORS_HELP = "exceptions and timeouts in the tier's operations (served as misses), by operation"


@dataclass
class TierStats:
    """Counters of one tier (monotonic, except the two gauges at the end). Updated in place by
    the tier and the store; ``snapshot`` copies them."""

    hits: int = metric("kvwise_kv_tier_hits", "KV entries found in the tier", default=0)
    misses: int = metric(  # faults excluded
        "kvwise_kv_tier_misses", "KV entries looked for and not found in the tier", default=0
    )
    bytes_read: int = metric("kvwise_kv_tier_read_bytes", "bytes read from the tier", default=0)
    bytes_written: int = metric(
        "kvwise_kv_tier_written_bytes", "bytes written to the tier", default=0
    )
    load_seconds: float = metric(  # wall time inside get
        "kvwise_kv_tier_load_seconds", "seconds spent reading from the tier", default=0.0
    )
    loads: int = metric(  # get calls that read something
        "kvwise_kv_tier_loads", "reads from the tier that returned entries", default=0
    )
    evictions: int = metric(
        "kvwise_kv_tier_evictions", "entries the tier dropped (budget or expiry)", default=0
    )
    faults: int = metric(
        "kvwise_kv_tier_faults", "I/O errors, timeouts and corrupt entries (as misses)", default=0
    )
    loaded_tokens: int = metric(  # counted by the store: a chunk by its first group's tier
        "kvwise_kv_tier_loaded_tokens",
        "prompt tokens loaded from the tier into the pool",
        default=0,
    )
    keeps_refused: int = metric(  # counted by host and disk (index.KeepLog)
        "kvwise_kv_tier_keeps_refused",
        "entries stored in plain LRU order though asked to be kept: the tenant was at its cap",
        default=0,
    )
    read_errors: int = metric(  # counted by base.FaultLog (health.TierHealth's operations)
        _ERRORS, _ERRORS_HELP, labels={"op": "read"}, default=0
    )
    write_errors: int = metric(_ERRORS, _ERRORS_HELP, labels={"op": "write"}, default=0)
    lookup_errors: int = metric(_ERRORS, _ERRORS_HELP, labels={"op": "lookup"}, default=0)
    delete_errors: int = metric(_ERRORS, _ERRORS_HELP, labels={"op": "delete"}, default=0)
    num_entries: int = metric(
        "kvwise_kv_tier_entries", "KV entries held by the tier", GAUGE, default=0
    )
    num_bytes: int = metric("kvwise_kv_tier_bytes", "bytes held by the tier", GAUGE, default=0)
    breaker_open: int = metric(  # set by snapshot, from ``health``
        "kvwise_tier_breaker_open",
        "1 while the tier's breaker is open (consecutive errors): the store skips it",
        GAUGE,
        default=0,
    )
    degraded: str = ""  # why the tier is degraded, "" when it is not (set by snapshot)
    # the tier's errors and breaker (``health.TierHealth``), shared by every FaultLog of this
    # tier: made by the first (``base.FaultLog``); None in a snapshot (plain data, picklable)
    health: TierHealth | None = dataclasses.field(default=None, repr=False, compare=False)

    def snapshot(self) -> TierStats:
        """A copy, unaffected by later updates, with the breaker's state and the reason."""
        health = self.health
        if health is None:
            return dataclasses.replace(self)
        return dataclasses.replace(
            self, breaker_open=int(health.is_open()), degraded=health.reason(), health=None
        )


_DECISIONS = "kvwise_kv_store_decisions"
_DECISIONS_HELP = "stored-prefix hits by what the cost model chose: load from a tier or recompute"


@dataclass(frozen=True)
class StoreStats:
    """The store's counters at one moment, and a snapshot of each tier's (in tier order)."""

    load_decisions: int = metric(  # stored continuations the cost model chose to load
        _DECISIONS, _DECISIONS_HELP, labels={"decision": "load"}
    )
    recompute_decisions: int = metric(  # ... chose to recompute (all or part of)
        _DECISIONS, _DECISIONS_HELP, labels={"decision": "recompute"}
    )
    lookup_misses: int = metric(  # prompts (past their device hit) that no tier continued
        "kvwise_kv_store_lookup_misses",
        "prompts whose continuation past the device pool no tier held",
    )
    loaded_tokens: int = metric(  # verified
        "kvwise_kv_store_loaded_tokens", "prompt tokens loaded from the tiers"
    )
    chunks_written: int = metric(
        "kvwise_kv_store_chunks_written", "KV entries written to the tiers"
    )
    writes_dropped: int = metric(  # writes and promotions dropped: queue over its cap, or closed
        "kvwise_kv_store_writes_dropped",
        "KV entries not written because the write queue was full",
    )
    pending_write_bytes: int = metric(
        "kvwise_kv_store_pending_write_bytes",
        "bytes queued for the tiers, not yet written",
        GAUGE,
    )
    tiers: dict[str, TierStats]  # each tier's, by name: TierStats' series, label ``tier``
    recomputed_tokens: int = metric(
        "kvwise_kv_store_recomputed_tokens",
        "stored prefix tokens the cost model chose to recompute rather than load",
        default=0,
    )
