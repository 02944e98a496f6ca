"""One tenant's retention never starves another's entries: in the host and disk tiers a tenant
may keep at most its share of the budget; past it, its entries go in plain LRU order.

In the issue: a tenant's 24-hour prefixes pushed another tenant's cached tokens from 352 to 0
in these tiers, and the pins survived restarts.
"""

from __future__ import annotations

import pytest

from kvwise.store.disk import DiskStore
from kvwise.store.host import HostStore
from kvwise.types import RequestOptions, SamplingParams
from tests.fakes import fake_engine
from tests.store_util import FakeClock, key, value

DAY = 24 * 3600.0


@pytest.fixture(params=["host", "disk"])
def make_store(request, tmp_path):
    stores = []

    def make(capacity_bytes: int, fraction: float | None = 0.5, clock=None):
        clock = clock or FakeClock()
        if request.param == "host":
            store = HostStore(capacity_bytes, clock=clock, max_kept_fraction_per_tenant=fraction)
        else:
            store = DiskStore(
                tmp_path / "kv", capacity_bytes, clock=clock, max_kept_fraction_per_tenant=fraction
            )
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_a_tenant_keeps_at_most_its_share_and_others_still_fit(make_store):
    store = make_store(1000)
    for i in range(10):  # alice asks to keep 1,000 bytes: the whole tier
        assert store.put([(key(i), value(i))], ttl_s=DAY, owner="alice")
    assert store.stats.keeps_refused == 5  # she keeps 500; the rest is plain LRU
    for i in range(100, 105):  # bob's plain entries push out alice's unkept ones, not his own
        assert store.put([(key(i), value(i))], owner="bob")
    assert all(store.contains([key(i) for i in range(100, 105)]))
    assert store.contains([key(i) for i in range(10)]) == [True] * 5 + [False] * 5
    # more of bob: alice's kept half stays, bob has the other half in LRU order
    for i in range(105, 110):
        store.put([(key(i), value(i))], owner="bob")
    assert store.contains([key(i) for i in range(5)]) == [True] * 5
    assert sum(store.contains([key(i) for i in range(100, 110)])) == 5


def test_without_the_cap_one_tenant_starves_the_rest(make_store):
    """The failure the cap prevents (fraction None: no cap)."""
    store = make_store(1000, fraction=None)
    for i in range(10):
        store.put([(key(i), value(i))], ttl_s=DAY, owner="alice")
    for i in range(100, 105):
        store.put([(key(i), value(i))], owner="bob")
    # each of bob's entries pushes out his previous one: he holds one entry at a time
    assert sum(store.contains([key(i) for i in range(100, 105)])) == 1


def test_keeps_are_per_tenant_expire_and_are_not_extended_by_others(make_store):
    clock = FakeClock()
    store = make_store(1000, clock=clock)
    store.put([(key(i), value(i)) for i in range(5)], ttl_s=60, owner="alice")  # at her cap
    store.put([(key(i), value(i)) for i in range(5, 10)], ttl_s=60, owner="bob")  # his own
    assert store.stats.keeps_refused == 0
    # bob re-putting alice's entry does not move it onto his account, nor extend it
    store.put([(key(0), value(0))], ttl_s=DAY, owner="bob")
    clock.t += 61  # every keep has run out: alice may keep again
    store.put([(key(20), value(20))], ttl_s=60, owner="alice")
    assert store.stats.keeps_refused == 0
    assert store.contains([key(20)]) == [True]


def test_disk_keeps_after_a_restart_are_capped_as_one_tenants(tmp_path):
    clock = FakeClock()
    store = DiskStore(tmp_path / "kv", 1000, clock=clock, max_kept_fraction_per_tenant=0.5)
    store.put([(key(i), value(i)) for i in range(5)], ttl_s=DAY, owner="alice")
    store.put([(key(i), value(i)) for i in range(5, 10)], ttl_s=DAY, owner="bob")
    assert store.stats.keeps_refused == 0  # 500 bytes each: both at their cap
    store.close()
    store = DiskStore(tmp_path / "kv", 1000, clock=clock, max_kept_fraction_per_tenant=0.5)
    try:
        assert all(store.contains([key(i) for i in range(10)]))  # every entry is still there
        # but only 500 bytes of them are still kept: a newcomer's entries push out the rest
        for i in range(100, 105):
            store.put([(key(i), value(i))], owner="carol")
        assert all(store.contains([key(i) for i in range(100, 105)]))
        assert sum(store.contains([key(i) for i in range(10)])) == 5
    finally:
        store.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_engine_a_tenants_retention_leaves_room_for_another_tenant(fraction):
    """Whole engines on the fake runner with a host tier: alice keeps far more 24-hour prompts
    than the tier holds, then bob sends four prompts and comes back to his first: it loads
    from the host tier. With the cap at the whole tier (1.0), alice's keeps fill it and bob's
    entries push each other out: his first prompt is gone (the failure of the issue)."""
    engine = fake_engine(
        num_blocks=48,
        kv_host_memory="64KiB",
        kv_store_min_tokens=8,
        kv_load_policy="always",
        kv_max_kept_fraction_per_tenant=fraction,
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    bob = RequestOptions(tenant="bob")
    bob_prompts = [
        f"bob's own long prompt {i} that he may send again later: " * 2 for i in range(4)
    ]

    def run(prompt, options):
        engine.add_request(prompt, params, options)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        engine.flush()
        return outs[-1]

    for i in range(60):
        run(f"alice keeps this prompt number {i:03d} for a day, please: " * 2,
            RequestOptions(tenant="alice", retention="24h"))  # fmt: skip
    for prompt in bob_prompts:
        run(prompt, bob)
    again = run(bob_prompts[0], bob)
    host = engine.store.stats().tiers["host"]
    engine.close()
    if fraction == 0.5:
        assert host.keeps_refused > 0
        assert again.num_loaded_tokens > 0, "alice's retention pushed bob out of the tier"
    else:
        assert again.num_loaded_tokens == 0
