"""A hit refreshes a cache breakpoint's (or a retention's) TTL in the tiers, as it does in the
pool (issue 46, item 2: "refreshed on each hit, in the pool and — when it leaves the pool —
in the tiers"). A stored entry is never rewritten for it: the tiers extend the keep of the
entries they hold (``base.ExtendsKeeps``), never shorten it, within the tenant's cap.

Before this, a save skipped the entries the tiers held, so they kept the TTL of their first
write: a breakpoint read every minute from the host tier ran out there after its first
5 minutes, and plain traffic pushed it out (the engine test below fails that way)."""

from __future__ import annotations

import time

import pytest

from kvwise.core.kv_tiers import ChunkWrite
from kvwise.store.base import ExtendsKeeps
from kvwise.store.disk import DiskStore
from kvwise.store.host import HostStore
from kvwise.store.index import LruIndex
from kvwise.types import RequestOptions, SamplingParams
from tests.fakes import fake_engine
from tests.store_util import FakeClock, key, make_store, value


def test_index_extends_present_keys_never_shortens_and_respects_the_cap():
    index = LruIndex(max_kept_bytes_per_keeper=200)
    index.add(key(0), 100, 0.0, now=10.0)  # plain
    index.add(key(1), 100, 50.0, now=10.0, keeper="alice")  # kept until 50
    assert index.extend(key(9), 99.0, "alice", now=10.0) is None  # absent
    assert index.extend(key(1), 30.0, "alice", now=10.0) == 50.0  # never shortened
    assert index.extend(key(1), 80.0, "alice", now=10.0) == 80.0
    assert index.extend(key(0), 70.0, "alice", now=10.0) == 70.0  # plain becomes kept
    assert index.kept_bytes == {"alice": 200}
    assert index.order() == [key(1), key(0)]  # the newly kept one last
    # another keeper's live keep is not extended (nor moved onto its account)
    assert index.extend(key(1), 99.0, "bob", now=10.0) == 80.0
    index.add(key(2), 100, 0.0, now=10.0)
    assert index.extend(key(2), 99.0, "alice", now=10.0) == 0.0  # alice is at her cap
    assert index.keep_until(key(2)) == 0.0 and len(index) == 3


@pytest.fixture(params=["host", "disk"])
def local_store(request, tmp_path):
    clock = FakeClock()
    if request.param == "host":
        store = HostStore(1000, clock=clock, max_kept_fraction_per_tenant=0.5)
    else:
        store = DiskStore(tmp_path / "kv", 1000, clock=clock, max_kept_fraction_per_tenant=0.5)
    yield store, clock
    store.close()


def test_local_tiers_keep_a_refreshed_entry_past_its_first_ttl(local_store):
    store, clock = local_store
    assert isinstance(store, ExtendsKeeps)
    store.put([(key(0), value(0))], ttl_s=60, owner="alice")
    clock.t += 50
    store.extend_keeps([key(0), key(99)], 60, owner="alice")  # a hit: 60 s from now
    clock.t += 50  # past the first 60 s, within the refreshed ones
    for i in range(1, 10):  # plain traffic fills the tier: the kept entry stays
        store.put([(key(i), value(i))], owner="bob")
    assert store.contains([key(0)]) == [True]
    assert store.eviction_order()[-1] == key(0)
    clock.t += 11  # its refreshed keep has run out too: plain LRU, evicted first
    store.put([(key(20), value(20))], owner="bob")
    assert store.contains([key(0)]) == [False]


def test_local_tiers_refuse_a_refresh_past_the_tenants_cap(local_store):
    store, _ = local_store
    store.put([(key(i), value(i)) for i in range(6)], owner="alice")  # plain
    store.extend_keeps([key(i) for i in range(6)], 60, owner="alice")
    assert store.stats.keeps_refused == 1  # 5 x 100 bytes is her share of 1,000
    assert store.eviction_order()[0] == key(5)


def test_disk_refresh_survives_a_restart(tmp_path):
    clock = FakeClock()
    store = DiskStore(tmp_path / "kv", 1000, clock=clock)
    store.put([(key(0), value(0))], ttl_s=60, owner="alice")
    store.extend_keeps([key(0)], 600, owner="alice")
    store.close()
    clock.t += 300  # past the write's 60 s, within the refresh's 600 s
    store = DiskStore(tmp_path / "kv", 1000, clock=clock)
    try:
        for i in range(1, 12):  # more than the budget of plain entries: the kept one stays
            store.put([(key(i), value(i))])
        assert store.contains([key(0)]) == [True]
    finally:
        store.close()


def test_plan_keeps_names_only_the_entries_known_as_stored():
    store = make_store(HostStore(1 << 20), min_tokens=4, chunk_blocks=2)
    hashes = [key(100 + i) for i in range(5)]
    assert store.plan_keeps(hashes, 5) == []
    writes = store.plan_writes(hashes, 3)  # entries [0, 2) and [2, 3)
    assert [(w.first_block, len(w.block_hashes)) for w in writes] == [(0, 2), (2, 1)]
    keeps = store.plan_keeps(hashes, 5, cuts=(3,))
    assert [(c.first_block, len(c.block_hashes)) for c in keeps] == [(0, 2), (2, 1)]
    store.close()


def test_tiered_store_keep_reaches_every_layer_group_of_each_entry():
    host = HostStore(1 << 20)
    store = make_store(host)
    fmt = store.fmt
    chunk = ChunkWrite(0, (key(100), key(101)))
    keys = [fmt.entry_key(chunk.key, g) for g in range(fmt.layer_groups)]
    host.put([(k, value(0)) for k in keys])  # plain
    store.keep([chunk], 60, owner="alice")
    store.flush()
    assert all(host._index.keep_until(k) > 0 for k in keys)
    store.close()


# ---- the engine: a hit refreshes what the tiers keep ----------------------------------


def _serve(engine, prompt, options):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rid = engine.add_request(prompt, params, options)
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    engine.flush()
    return result


def test_engine_a_breakpoint_read_from_the_pool_stays_kept_in_the_host_tier():
    """A 5m breakpoint (scaled to 4 s) is written to the host tier, read again from the pool
    at 2.5 s (which refreshes it to 6.5 s), then the pool forgets it and other traffic fills
    the host tier at 5 s: the tier still keeps it, and the next request loads it."""
    engine = fake_engine(
        num_blocks=96,
        kv_host_memory="24KiB",
        kv_store_min_tokens=8,
        kv_load_policy="always",
        cache_min_tokens=16,
        cache_ttl_scale=4 / 300,
    )
    try:
        system = "You are the depot's dispatcher; answer in one line. " * 2  # 104 tokens
        keep = RequestOptions(tenant="alice", cache_breakpoints=[(len(system), 300)])
        start = time.monotonic()
        first = _serve(engine, system + "Q1", keep)
        assert first.num_cached_tokens == 0
        time.sleep(max(0.0, start + 2.5 - time.monotonic()))
        second = _serve(engine, system + "Q2", keep)  # a pool hit: the keep is refreshed
        assert second.num_cached_tokens >= 96 and second.num_loaded_tokens == 0
        time.sleep(max(0.0, start + 5.0 - time.monotonic()))  # past the first write's 4 s
        engine.kv_manager.pool.reset_prefix_cache()
        for i in range(8):  # bob's plain prompts fill the host tier
            _serve(engine, f"bob's unrelated prompt number {i}, long enough to be stored " * 2,
                   RequestOptions(tenant="bob"))  # fmt: skip
        engine.kv_manager.pool.reset_prefix_cache()
        assert time.monotonic() - start < 6.3, "too slow a machine for this test's clock"
        third = _serve(engine, system + "Q3", keep)
        assert third.num_loaded_tokens >= 96, "the refreshed breakpoint left the host tier"
        host = engine.store.stats().tiers["host"]
        assert host.evictions > 0 and host.keeps_refused == 0
    finally:
        engine.close()
