"""Typed engine statistics: what ``llm.stats()``, ``/metrics`` and the benchmarks read, by
attribute. Built fresh (and immutable) on every call, so a snapshot can cross threads."""

from __future__ import annotations

from dataclasses import dataclass

from kvwise.core.kv_cache_manager import KVCacheStats
from kvwise.store.tiered import StoreStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # requests preempted for lack of KV blocks (total)
    num_load_rollbacks: int  # loads from the tiers that came up short (total)
    kv: KVCacheStats  # the device pool and the prefix cache
    store: StoreStats | None = None  # the tiers below the pool; None without tiers
    kv_integrity_checks: int = 0  # idle-time pool audits passed (the async engine's)
