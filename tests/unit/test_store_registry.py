"""Tier kinds are listed once, in the registry: built from a ``StoreConfig`` in order, extra
kinds registered below the built-in ones; ``TierStats`` carries its metric names."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvwise.config import StoreConfig
from kvwise.core.kv_spec import KVSpec
from kvwise.store import registry
from kvwise.store.base import KVStore
from kvwise.store.disk import DiskStore
from kvwise.store.factory import build_store
from kvwise.store.host import HostStore
from kvwise.store.redis import RedisStore
from kvwise.store.stats import TierStats
from tests.store_util import MemoryTier, chain, payload

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")


@pytest.fixture
def mem_tier():
    registry.register_tier("mem", lambda config: MemoryTier())
    yield
    registry.unregister_tier("mem")


def config(tmp_path, **kw) -> StoreConfig:
    base = {"kv_host_memory": "1MiB", "kv_disk_path": str(tmp_path), "kv_disk_size": "1MiB"}
    return StoreConfig(**{**base, **kw, "kv_store_min_tokens": 4, "kv_chunk_blocks": 4})


def test_built_in_tiers_in_order_and_off_when_the_config_says_so(tmp_path):
    assert registry.tier_names() == ["host", "disk", "redis"]
    tiers = registry.build_tiers(config(tmp_path, kv_redis_url="redis://127.0.0.1:1/0"))
    assert [type(t) for t in tiers] == [HostStore, DiskStore, RedisStore]
    assert [t.name for t in tiers] == ["host", "disk", "redis"]
    assert all(isinstance(t, KVStore) for t in tiers)
    for t in tiers:
        t.close()
    assert registry.build_tiers(config(tmp_path, kv_host_memory="off", kv_disk_path="off")) == []


def test_a_registered_tier_is_built_below_the_built_in_ones(tmp_path, mem_tier, caplog):
    with caplog.at_level(logging.INFO, logger="kvwise"):
        store = build_store(config(tmp_path, kv_layer_groups=4), SPEC, "model-x", 512)
    assert [t.name for t in store.tiers] == ["host", "disk", "mem"]
    assert store.layer_groups == 2  # at most one per layer
    assert (store.chunk_blocks, store.block_size, store.policy) == (4, 4, "auto")
    assert "host 1.0 MiB → disk 1.0 MiB at" in caplog.text
    assert "(0 entries found) → mem (0 entries)" in caplog.text
    h = chain(4)
    for w in store.plan_writes(h, 4):
        store.write(w, payload(list(w.block_hashes)))
    store.flush()
    stats = store.stats()
    assert list(stats.tiers) == ["host", "disk", "mem"]
    assert stats.tiers["mem"].bytes_written == stats.tiers["host"].bytes_written > 0
    assert store.num_stored_blocks(h, 4) == 4
    store.close()


def test_a_tier_name_is_registered_once(mem_tier):
    with pytest.raises(ValueError, match="mem"):
        registry.register_tier("mem", lambda config: None)
    registry.unregister_tier("mem")
    assert "mem" not in registry.tier_names()


def test_tier_stats_name_their_metrics():
    expected = {
        "hits": ("kvwise_kv_tier_hits", "KV entries found in the tier", "counter"),
        "misses": (
            "kvwise_kv_tier_misses",
            "KV entries looked for and not found in the tier",
            "counter",
        ),
        "bytes_read": ("kvwise_kv_tier_read_bytes", "bytes read from the tier", "counter"),
        "bytes_written": ("kvwise_kv_tier_written_bytes", "bytes written to the tier", "counter"),
        "loads": ("kvwise_kv_tier_loads", "reads from the tier that returned entries", "counter"),
        "load_seconds": (
            "kvwise_kv_tier_load_seconds",
            "seconds spent reading from the tier",
            "counter",
        ),
        "evictions": (
            "kvwise_kv_tier_evictions",
            "entries the tier dropped (budget or expiry)",
            "counter",
        ),
        "faults": (
            "kvwise_kv_tier_faults",
            "I/O errors, timeouts and corrupt entries (as misses)",
            "counter",
        ),
        "loaded_tokens": (
            "kvwise_kv_tier_loaded_tokens",
            "prompt tokens loaded from the tier into the pool",
            "counter",
        ),
        "keeps_refused": (
            "kvwise_kv_tier_keeps_refused",
            "entries stored in plain LRU order though asked to be kept: the tenant was at its cap",
            "counter",
        ),
        "num_entries": ("kvwise_kv_tier_entries", "KV entries held by the tier", "gauge"),
        "num_bytes": ("kvwise_kv_tier_bytes", "bytes held by the tier", "gauge"),
        "breaker_open": (
            "kvwise_tier_breaker_open",
            "1 while the tier's breaker is open (consecutive errors): the store skips it",
            "gauge",
        ),
    }
    errors = "exceptions and timeouts in the tier's operations (served as misses), by operation"
    for op in ("read", "write", "lookup", "delete"):  # one family, told apart by op
        expected[f"{op}_errors"] = ("kvwise_tier_errors", errors, "counter", {"op": op})
    got = {
        f.name: (f.metadata["metric"], f.metadata["help"], f.metadata["kind"])
        + ((f.metadata["labels"],) if f.metadata["labels"] else ())
        for f in dataclasses.fields(TierStats)
        if "metric" in f.metadata
    }
    assert got == expected
    # the reason a tier is degraded and its live health are no series
    assert {f.name for f in dataclasses.fields(TierStats) if "metric" not in f.metadata} == {
        "degraded",
        "health",
    }


def test_tier_stats_snapshot_is_a_copy():
    stats = TierStats(hits=3, load_seconds=0.5)
    snap = stats.snapshot()
    stats.hits += 1
    assert (snap.hits, snap.load_seconds, stats.hits) == (3, 0.5, 4)
    assert TierStats().load_seconds == 0.0 and isinstance(TierStats().load_seconds, float)
