"""A real redis-server stopped (SIGSTOP) while an engine uses it: the tier is a miss within
its deadline, the breaker opens, answers stay token-identical, and once the server runs again
(SIGCONT) and the window is over, loads come from it again. On the fake runner."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvwise.types import SamplingParams
from tests.fakes import fake_engine, run_all
from tests.tiers_util import evict_device

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = "A conversation long enough to be stored in Redis, " * 3  # 37 full blocks of 4
FULL_TOKENS = (len(LONG) - 1) // 4 * 4
DEADLINE_S = 0.3


@pytest.mark.parametrize("when", ["before-lookup", "between-lookup-and-load"])
def test_a_stopped_server_is_a_miss_within_its_deadline(start_redis, when):
    server = start_redis()
    reference = run_all(fake_engine(), [LONG, LONG + "!"], P)
    engine = fake_engine(
        kv_redis_url=server.url,
        kv_store_secret="0123456789abcdef" * 4,
        kv_store_min_tokens=8,
        kv_load_policy="always",
        kv_redis_timeout=DEADLINE_S,
    )
    (redis_tier,) = engine.store.tiers
    redis_tier.retry_after_s = 1.0
    assert run_all(engine, [LONG], P)[0].token_ids == reference[0].token_ids
    evict_device(engine)

    def stop() -> None:
        os.kill(server.proc.pid, signal.SIGSTOP)

    if when == "before-lookup":
        stop()
    else:  # the lookup finds the entries, the server stops before they are read
        get, stopped = redis_tier.get, threading.Event()

        def stop_then_get(keys):
            if not stopped.is_set():
                stopped.set()
                stop()
            return get(keys)

        redis_tier.get = stop_then_get
    try:
        start = time.monotonic()
        out = run_all(engine, [LONG], P)[0]
        seconds = time.monotonic() - start
        assert out.token_ids == reference[0].token_ids and out.num_loaded_tokens == 0
        assert seconds < 3 * DEADLINE_S, seconds
        faults = redis_tier.stats.faults
        assert faults >= 1  # (a load's parallel reads each count theirs)
        assert engine.stats().num_load_rollbacks == (when != "before-lookup")
        start = time.monotonic()
        out = run_all(engine, [LONG + "!"], P)[0]  # the breaker is open: no wait
        assert out.token_ids == reference[1].token_ids
        assert time.monotonic() - start < DEADLINE_S / 2
        start = time.monotonic()
        engine.flush()  # their writes: refused at once while the breaker is open
        assert time.monotonic() - start < DEADLINE_S
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        redis_tier.__dict__.pop("get", None)
    time.sleep(1.1)  # past the window: the next call probes the tier, and it is back
    redis_tier.contains([bytes(32)])
    assert redis_tier.wait_probes()
    evict_device(engine)
    out = run_all(engine, [LONG], P)[0]  # the entries stored before the stop are loaded
    assert out.token_ids == reference[0].token_ids and out.num_loaded_tokens == FULL_TOKENS
    assert redis_tier.stats.faults == faults
    engine.close()
