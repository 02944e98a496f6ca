"""Writes lost while Redis was down are written again once it is back (on the fake runner,
against a real redis-server): the store remembers only chunks the tiers confirmed."""

import time

from kvwise.types import SamplingParams
from tests.fakes import fake_engine, run_all
from tests.tiers_util import evict_device

P = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = "A conversation long enough to be stored in Redis, " * 3  # 150 bytes: 37 full blocks
FULL_TOKENS = (len(LONG) - 1) // 4 * 4


def test_writes_lost_in_an_outage_are_written_after_recovery(start_redis):
    server = start_redis()
    engine = fake_engine(
        kv_redis_url=server.url,
        kv_store_secret="the secret of this installation, long enough",
        kv_store_min_tokens=8,
        kv_load_policy="always",
        kv_redis_timeout=0.5,
    )
    (redis_tier,) = engine.store.tiers
    redis_tier.retry_after_s = 0.2  # the breaker: retry soon after the server is back
    server.kill()
    first = run_all(engine, [LONG], P)[0]
    engine.flush()
    assert redis_tier.stats.faults >= 1  # the writes (and the lookup) failed
    server.start()  # the same port, empty
    client = server.client()
    assert client.dbsize() == 0
    time.sleep(0.3)  # past the breaker's window: the next call probes the tier, and it is back
    redis_tier.contains([bytes(32)])
    assert redis_tier.wait_probes()
    evict_device(engine)
    second = run_all(engine, [LONG], P)[0]  # recomputed; its blocks are saved again
    assert second.num_loaded_tokens == 0 and second.token_ids == first.token_ids
    engine.flush()
    assert client.dbsize() > 0  # written this time: the lost chunks were not "known"
    evict_device(engine)
    third = run_all(engine, [LONG], P)[0]
    assert third.num_loaded_tokens == FULL_TOKENS and third.token_ids == first.token_ids
    client.close()
    engine.close()
