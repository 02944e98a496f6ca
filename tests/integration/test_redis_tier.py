"""The Redis tier against a real redis-server: round trips, TTLs, passwords, sharing, and
faults (server killed, server hung) served as fast misses."""

from __future__ import annotations

import time

import pytest

from kvwise.store.base import KVStore
from kvwise.store.redis import RedisStore
from tests.store_util import FakeClock, key, value

from .conftest import free_port

PREFIX = "kvwise:kv:"


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - start


@pytest.fixture
def stores():
    made: list[RedisStore] = []

    def make(url: str, **kwargs) -> RedisStore:
        kwargs.setdefault("timeout_s", 0.2)
        kwargs.setdefault("retry_after_s", 0.2)
        store = RedisStore(url, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def test_round_trip(redis_db, stores):
    store = stores(redis_db.url)
    assert isinstance(store, KVStore)
    store.put([(key(0), value(0)), (key(1), bytearray(value(1, 50)))])
    assert store.contains([key(0), key(1), key(2)]) == [True, True, False]
    assert store.get([key(1), key(2), key(0)]) == [value(1, 50), None, value(0)]
    assert (store.stats.hits, store.stats.misses, store.stats.loads) == (2, 1, 1)
    assert store.stats.bytes_read == store.stats.bytes_written == 150
    assert store.stats.faults == 0

    # one Redis key per entry, holding exactly the entry bytes
    client = redis_db.client()
    assert sorted(client.keys("*")) == sorted((PREFIX + key(i).hex()).encode() for i in (0, 1))
    assert client.get(PREFIX + key(0).hex()) == value(0)

    store.delete([key(0), key(2)])
    assert store.contains([key(0), key(1)]) == [False, True]
    store.close()
    store.close()
    assert store.get([key(1)]) == [None]
    assert store.contains([key(1)]) == [False]
    store.put([(key(3), value(3))])
    assert client.exists(PREFIX + key(3).hex()) == 0
    assert store.stats.faults == 0


def test_ttl_is_at_least_the_stores(redis_db, stores):
    store = stores(redis_db.url, ttl_s=3600)
    client = redis_db.client()
    store.put([(key(0), value(0))])
    store.put([(key(1), value(1))], ttl_s=10)  # shorter than the store's: the store's wins
    store.put([(key(2), value(2))], ttl_s=7200.5)
    assert 3590 < client.ttl(PREFIX + key(0).hex()) <= 3600
    assert 3590 < client.ttl(PREFIX + key(1).hex()) <= 3600
    assert 7190 < client.ttl(PREFIX + key(2).hex()) <= 7201

    short = stores(redis_db.url, ttl_s=0.3, prefix="other:")
    short.put([(key(0), value(0))])
    assert client.ttl("other:" + key(0).hex()) == 1  # whole seconds, at least 1


def test_two_engines_share_entries(redis_db, stores):
    first, second = stores(redis_db.url), stores(redis_db.url)
    first.put([(key(0), value(0))])
    assert second.get([key(0)]) == [value(0)]
    second.put([(key(1), value(1))])
    assert first.contains([key(0), key(1)]) == [True, True]
    other_ns = stores(redis_db.url, prefix="tenant2:")
    assert other_ns.get([key(0)]) == [None]


def test_password_url(start_redis, stores):
    server = start_redis(password="s3cret")
    store = stores(server.url)
    store.put([(key(0), value(0))])
    assert store.get([key(0)]) == [value(0)]
    assert store.stats.faults == 0

    wrong = stores(f"redis://:nope@127.0.0.1:{server.port}/0")
    assert wrong.get([key(0)]) == [None]
    assert wrong.stats.faults == 1
    no_password = stores(f"redis://127.0.0.1:{server.port}/0")
    assert no_password.contains([key(0)]) == [False]
    assert no_password.stats.faults == 1


def test_bad_url_names_the_field():
    with pytest.raises(ValueError, match="kv_redis_url"):
        RedisStore("http://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="kv_redis_url"):
        RedisStore("127.0.0.1:6379")


def test_unreachable_server_at_start_is_a_fault_not_an_error(stores):
    store = stores(f"redis://127.0.0.1:{free_port()}/0")
    got, seconds = timed(store.get, [key(0)])
    assert got == [None] and seconds < 2
    assert (store.stats.faults, store.stats.misses) == (1, 0)


def test_killed_server_costs_one_fault_per_retry_window(redis_db, stores):
    clock = FakeClock()
    store = stores(redis_db.url, retry_after_s=5.0, clock=clock)
    store.put([(key(0), value(0))])
    assert store.get([key(0)]) == [value(0)]

    redis_db.kill()
    got, seconds = timed(store.get, [key(0), key(1)])
    assert got == [None, None] and seconds < 2
    assert store.stats.faults == 1

    # down: answers at once, no network (a network call would fault again)
    for call, args, expected in (
        (store.get, [[key(0)]], [None]),
        (store.contains, [[key(0)]], [False]),
        (store.put, [[(key(2), value(2))]], False),  # not stored: written again later
        (store.delete, [[key(0)]], None),
    ):
        got, seconds = timed(call, *args)
        assert got == expected and seconds < 0.1
    assert store.stats.faults == 1
    assert store.stats.misses == 0

    clock.t += 5.0  # the window is over: the next call probes (in the background: a miss
    got, seconds = timed(store.put, [(key(2), value(2))])  # at once), and faults again
    assert got is False and seconds < 0.1
    assert store.wait_probes()
    assert store.stats.faults == 2
    assert store.stats.bytes_written == 100  # only the first put reached the server

    redis_db.restart()  # empty: no persistence
    assert store.get([key(0)]) == [None]  # still down
    clock.t += 5.0
    assert store.contains([key(0)]) == [False] and store.wait_probes()  # the probe: up again
    store.put([(key(3), value(3))])
    assert store.get([key(3), key(0)]) == [value(3), None]
    assert store.stats.faults == 2


def test_killed_server_real_clock(redis_db, stores):
    store = stores(redis_db.url, retry_after_s=0.2)
    store.put([(key(0), value(0))])
    redis_db.kill()
    for call, args in ((store.get, [[key(0)]]), (store.contains, [[key(0)]])):
        _, seconds = timed(call, *args)
        assert seconds < 2
    assert store.stats.faults == 1
    redis_db.restart()
    time.sleep(0.25)
    assert store.contains([key(0)]) == [False] and store.wait_probes()  # the probe: up again
    store.put([(key(1), value(1))])
    assert store.get([key(1)]) == [value(1)]
    assert store.stats.faults == 1


def test_hung_server_times_out(redis_db, stores):
    store = stores(redis_db.url, timeout_s=0.2, retry_after_s=0.2)
    store.put([(key(0), value(0))])
    pauser = redis_db.client()
    # NOTE: a paused server cannot be unpaused early (CLIENT UNPAUSE waits too)
    pauser.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    try:
        got, seconds = timed(store.get, [key(0)])
        assert got == [None]
        assert 0.15 < seconds < 0.8
        assert store.stats.faults == 1
        _, seconds = timed(store.contains, [key(0)])  # down: no second timeout
        assert seconds < 0.1
    finally:
        redis_db.client(timeout_s=5).ping()  # returns once the pause is over
    time.sleep(0.25)
    store.contains([key(0)])  # past the window: a probe (a miss at once) brings it back
    assert store.wait_probes()
    assert store.get([key(0)]) == [value(0)]
    assert store.stats.faults == 1


def test_extend_keeps_lengthens_a_ttl_and_never_shortens_it(redis_db):
    """A hit refreshes a breakpoint's TTL in the tiers (tests/unit/test_tier_keep_refresh.py):
    in Redis by EXPIRE ... GT."""
    store = RedisStore(redis_db.url, ttl_s=60, timeout_s=1.0)
    try:
        client = redis_db.client()
        name = "kvwise:kv:" + key(0).hex()
        store.put([(key(0), value(0))], ttl_s=100)
        assert 90 < client.ttl(name) <= 100
        store.extend_keeps([key(0), key(1)], 3600)  # an absent key is ignored
        assert 3590 < client.ttl(name) <= 3600
        store.extend_keeps([key(0)], 300)  # shorter: unchanged
        assert client.ttl(name) > 3500
        assert not client.exists("kvwise:kv:" + key(1).hex())
        assert store.stats.faults == 0
    finally:
        store.close()
