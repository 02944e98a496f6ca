"""A tier's optional abilities are protocols of store/base.py, checked with isinstance: each
built-in tier declares the ones it has, and a tier with none (a plug-in's dict) gets every
default."""

from kvwise.config import StoreConfig
from kvwise.store.base import (
    DEFAULT_DEADLINE_S,
    HasDeadline,
    HasLoadPrior,
    KeepsLocalSecret,
    KVStore,
    ReadsInPlace,
    ReportsEvictions,
    SharedTier,
    call_deadline,
)
from kvwise.store.disk import DiskStore
from kvwise.store.factory import load_priors, store_secret
from kvwise.store.host import HostStore
from kvwise.store.redis import RedisStore
from kvwise.store.tier_events import TierEvents
from tests.store_util import MemoryTier

ABILITIES = (
    HasDeadline,
    HasLoadPrior,
    KeepsLocalSecret,
    ReadsInPlace,
    ReportsEvictions,
    SharedTier,
)


def abilities(tier) -> set[str]:
    return {a.__name__ for a in ABILITIES if isinstance(tier, a)}


def test_each_tier_declares_what_it_can(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path, 1 << 20)
    redis_tier = RedisStore("redis://127.0.0.1:1/0", timeout_s=0.25)  # no network until used
    try:
        assert all(isinstance(t, KVStore) for t in (host, disk, redis_tier))
        assert abilities(host) == {"HasLoadPrior", "ReportsEvictions"}
        assert abilities(disk) == {
            "HasLoadPrior", "KeepsLocalSecret", "ReadsInPlace", "ReportsEvictions"
        }  # fmt: skip
        assert abilities(redis_tier) == {"HasDeadline", "HasLoadPrior", "SharedTier"}
        assert redis_tier.shared and call_deadline(redis_tier) == 0.25
        assert call_deadline(host) == call_deadline(disk) == DEFAULT_DEADLINE_S
        assert len(disk.local_secret()) == 32
    finally:
        for tier in (host, disk, redis_tier):
            tier.close()


def test_a_tier_with_no_optional_ability_gets_every_default(monkeypatch):
    monkeypatch.delenv("KVWISE_KV_SECRET", raising=False)
    tier, host = MemoryTier(), HostStore(1 << 20)
    assert isinstance(tier, KVStore) and abilities(tier) == set()
    assert call_deadline(tier) == DEFAULT_DEADLINE_S
    assert load_priors([tier, host]) == {"host": HostStore.load_prior}  # mem: the default
    secret = store_secret(StoreConfig(kv_host_memory="1MiB", kv_disk_path="off"), [tier])
    assert len(secret) == 32  # not shared, no secret of its own: one for this process
    events = TierEvents([tier, host], block_size=4)  # tracks host only
    events.stored("mem", [b"k"], [b"h"])
    assert events.take() == [] and host.on_evict is not None and not hasattr(tier, "on_evict")
