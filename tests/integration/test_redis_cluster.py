"""The Redis tier on a real 3-node Redis Cluster (``redis+cluster://``): entries spread over
every node's slots, each node is asked in one pipeline, and a killed node's entries become
misses while the others keep hitting."""

from __future__ import annotations

import pytest

from kvwise.store.redis import RedisStore
from tests.tiers_util import evict_device, run


def _keys(n: int) -> list[bytes]:
    return [bytes([i % 256, i // 256]) * 16 for i in range(n)]  # 32-byte keys


def test_entries_spread_over_the_nodes_and_come_back(redis_cluster):
    store = RedisStore(redis_cluster.url, ttl_s=60)
    keys = _keys(60)
    assert store.put([(k, b"value-" + k) for k in keys])
    holding = [node.client().dbsize() for node in redis_cluster.nodes]
    assert sum(holding) == 60 and all(n > 0 for n in holding)  # no single slot: every node
    assert store.get(keys) == [b"value-" + k for k in keys]
    assert store.contains(keys[:5] + [b"\x01" * 32]) == [True] * 5 + [False]
    store.delete(keys[:10])
    assert store.get(keys[:10]) == [None] * 10
    assert store.stats.faults == 0 and store.stats.hits == 60
    store.close()


def test_a_killed_node_is_a_miss_for_its_entries_only(redis_cluster):
    store = RedisStore(redis_cluster.url, ttl_s=60, timeout_s=0.5, retry_after_s=60)
    keys = _keys(60)
    assert store.put([(k, b"v" + k) for k in keys])
    victim = redis_cluster.nodes[1]
    on_victim = victim.client().dbsize()
    victim.kill()
    values = store.get(keys)
    hits = sum(v is not None for v in values)
    assert hits == 60 - on_victim and all(v in (None, b"v" + k) for v, k in zip(values, keys))
    assert store.stats.faults >= 1
    # the dead node is skipped at once from now on (its outage window), the rest still serve
    assert sum(v is not None for v in store.get(keys)) == 60 - on_victim
    assert not store.put([(b"\x07" * 32, b"new")]) or store.get([b"\x07" * 32]) == [b"new"]
    store.close()


def test_an_engine_loads_a_prefix_from_the_cluster(tier_engine, redis_cluster):
    kw = {
        "kv_redis_url": redis_cluster.url,
        "kv_store_secret": "a secret both engines share, long enough",
    }
    cold = run(tier_engine(**kw))
    engine = tier_engine(**kw)
    evict_device(engine)
    out = run(engine)
    assert out.num_loaded_tokens > 250 and out.token_ids == cold.token_ids
    assert engine.stats().store.tiers["redis"].hits > 0


@pytest.mark.parametrize("scheme", ["redis+cluster", "rediss+cluster"])
def test_cluster_urls_are_accepted_without_touching_the_network(scheme):
    store = RedisStore(f"{scheme}://:pw@127.0.0.1:1")  # the slot map is read on first use
    assert store.cluster
    assert store.get([b"\x00" * 32]) == [None]  # nothing listens: a fault, a miss
    assert store.stats.faults == 1
    store.close()


def test_a_bad_scheme_is_named():
    from kvwise.config import StoreConfig

    with pytest.raises(ValueError, match="^kv_redis_url:.*redis\\+cluster://"):
        StoreConfig(kv_redis_url="redis-cluster://127.0.0.1:7000")
    assert StoreConfig(kv_redis_url="redis+cluster://127.0.0.1:7000").kv_redis_url
