"""A Redis that misbehaves never stalls the step loop: against a fake server written for the
tests (``tests/fake_redis.py``) that answers the handshake wrongly, answers a byte at a time or
never answers, each call is a miss within its deadline (``kv_redis_timeout``, the whole call),
the fault is counted, the breaker opens (the next call costs nothing), and in a whole engine
another tenant's stream goes on while every answer stays token-identical."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvwise.engine.async_engine import AsyncEngine
from kvwise.store.redis import RedisStore
from kvwise.types import RequestOptions, SamplingParams
from tests.fake_redis import FakeRedis
from tests.fakes import ControlledRunner, fake_engine, run_all
from tests.store_util import key, value
from tests.tiers_util import evict_device

DEADLINE_S = 0.3
SECRET = "0123456789abcdef" * 4  # 64 hex digits: 32 bytes
# (mode, the commands it applies to: None for all); the last misbehaves on loads only
MODES = [("bad_handshake", None), ("drip", None), ("silent", None), ("drip", {"MGET"})]
IDS = ["bad-handshake", "drip", "silent", "drip-on-loads"]

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
LONG = "A conversation long enough to be stored in Redis, " * 3  # 37 full blocks of 4
SHORT = "hi"  # no full block: its admission asks no tier
ALICE, BOB = RequestOptions(tenant="alice"), RequestOptions(tenant="bob")


@pytest.fixture
def server():
    with FakeRedis(drip_s=0.1) as fake:  # each byte well within the socket timeout
        yield fake


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


@pytest.mark.parametrize("mode", ["bad_handshake", "drip", "silent"])
def test_each_call_is_a_miss_within_its_deadline_then_the_breaker_opens(server, mode):
    store = RedisStore(server.url, timeout_s=DEADLINE_S, retry_after_s=30)
    server.misbehave(mode)
    got, seconds = timed(store.contains, [key(0), key(1)])
    assert got == [False, False] and seconds < 3 * DEADLINE_S
    assert store.stats.faults == 1
    num_commands = len(server.commands)
    for call, args, expected in (
        (store.get, [key(0)], [None]),
        (store.contains, [key(0)], [False]),
        (store.put, [(key(2), value(2))], False),  # not stored: written again later
    ):
        got, seconds = timed(call, args)
        assert got == expected and seconds < 0.05  # down: no network
    assert store.stats.faults == 1 and len(server.commands) == num_commands
    # the connection stuck on the server was closed (its thread is free again)
    assert server.wait_connections(0, timeout_s=2)
    store.close()


@pytest.mark.parametrize("mode", ["bad_handshake", "drip", "silent"])
def test_a_server_that_stays_broken_costs_a_caller_one_deadline_in_all(server, mode):
    """Half-open: after each window a call is sent as a background probe and the caller gets
    its miss at once, so the engine's step loop (which looks entries up as it schedules)
    never waits for a broken server again; once the server behaves, a probe brings it back."""
    store = RedisStore(server.url, timeout_s=DEADLINE_S, retry_after_s=0.1)
    server.misbehave(mode)
    _, first = timed(store.contains, [key(0)])
    assert first > DEADLINE_S / 2 or mode == "bad_handshake"
    waits = []
    for _ in range(5):  # five windows
        time.sleep(0.15)
        got, seconds = timed(store.contains, [key(0)])
        assert got == [False]
        waits.append(seconds)
        assert store.wait_probes()
    assert max(waits) < 0.05, waits
    assert store.stats.faults == 6  # the first call and each probe
    server.behave()
    time.sleep(0.15)
    assert store.put([(key(1), value(1))]) is False  # down still: this one probes
    assert store.wait_probes()
    assert store.contains([key(1)]) == [True]  # the probe's write landed and the tier is up
    store.close()


def test_a_slow_reply_to_a_load_is_a_miss_within_its_deadline(server):
    store = RedisStore(server.url, timeout_s=DEADLINE_S, retry_after_s=30)
    assert store.put([(key(0), value(0))])
    server.misbehave("drip", {"MGET"})
    assert store.contains([key(0)]) == [True]  # lookups are fine
    got, seconds = timed(store.get, [key(0)])
    assert got == [None] and seconds < 3 * DEADLINE_S
    assert store.stats.faults == 1 and store.stats.hits == 0
    got, seconds = timed(store.get, [key(0)])
    assert got == [None] and seconds < 0.05
    store.close()


def test_a_reply_of_the_wrong_shape_is_a_fault_not_an_entry(server):
    store = RedisStore(server.url, timeout_s=DEADLINE_S, retry_after_s=30)
    server.data[(store.prefix + key(0).hex()).encode()] = value(0)
    server.misbehave("bad_handshake")  # the connection is made already: no effect
    store.contains([key(0)])
    # MGET answered with an integer: redis-py hands it back, the store refuses it
    server._reply = lambda name, args: 7 if name == "MGET" else FakeRedis._reply(server, name, args)
    assert store.get([key(0)]) == [None]
    assert store.stats.faults == 1 and store.stats.hits == 0
    store.close()


def _engine(server, **kwargs):
    return fake_engine(
        kv_redis_url=server.url,
        kv_store_secret=SECRET,
        kv_redis_timeout=DEADLINE_S,
        kv_store_min_tokens=8,
        kv_load_policy="always",
        wrap_runner=lambda runner: ControlledRunner(runner, delay_s=0.01),
        **kwargs,
    )


@pytest.fixture(scope="module")
def reference():
    """Every answer without Redis."""
    engine = fake_engine()
    return {
        prompt: run_all(engine, [prompt], params)[0].token_ids
        for prompt, params in ((LONG, P), (LONG + "!", P), (SHORT, STREAM))
    }


@pytest.mark.parametrize(("mode", "commands"), MODES, ids=IDS)
def test_another_tenants_stream_goes_on_and_every_answer_is_unchanged(
    server, reference, mode, commands
):
    engine = _engine(server)
    (redis_tier,) = engine.store.tiers
    if commands is not None:  # lookups work, loads do not: alice's prompt is stored first
        assert run_all(engine, [LONG], P, ALICE)[0].token_ids == reference[LONG]
        evict_device(engine)
    server.misbehave(mode, commands)
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def bob(arrivals: list[float]):
        outs = []
        async for out in async_engine.generate(SHORT, STREAM, options=BOB):
            arrivals.append(time.monotonic())
            outs.append(out)
        return outs[-1]

    async def alice(prompt: str):
        start, outs = time.monotonic(), []
        async for out in async_engine.generate(prompt, P, options=ALICE):
            outs.append((out, time.monotonic() - start))
        return outs[-1][0], outs[0][1]  # the last output, the time to the first

    async def main():
        arrivals: list[float] = []
        stream = asyncio.create_task(bob(arrivals))
        while len(arrivals) < 3:  # bob is streaming
            await asyncio.sleep(0.005)
        first, first_ttft = await alice(LONG)  # asks Redis (a lookup, or a load)
        faults = redis_tier.stats.faults
        second, second_ttft = await alice(LONG + "!")  # the breaker is open: no cost
        assert redis_tier.stats.faults == faults
        last = await stream
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        return first, first_ttft, second, second_ttft, last, max(gaps)

    try:
        first, first_ttft, second, second_ttft, last, max_gap = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert first.token_ids == reference[LONG] and first.num_loaded_tokens == 0
    assert second.token_ids == reference[LONG + "!"]
    assert last.token_ids == reference[SHORT] and len(last.token_ids) == 60
    assert first_ttft < 3 * DEADLINE_S, first_ttft  # the tier was a miss within its deadline
    assert second_ttft < DEADLINE_S / 2, second_ttft
    assert max_gap < 3 * DEADLINE_S, max_gap  # bob's stream waited at most one deadline
    assert redis_tier.stats.faults >= 1
    if commands is not None:
        assert engine.stats().num_load_rollbacks == 1  # planned, not delivered: recomputed
