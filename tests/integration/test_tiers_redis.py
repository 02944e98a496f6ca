"""The Redis tier under the default model, against a real redis-server: token-identical
round trips, a second engine process sharing the tier, tenant isolation across engines, and
faults (server killed, server hung) served as misses."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from tests.tiers_util import evict_device, run

pytestmark = pytest.mark.slow

# a second engine process: runs PROMPT for a tenant against a Redis tier, prints the result
SECOND_ENGINE = """
import json, sys
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine
from kvwise.engine.llm_engine import LLMEngine
from tests.tiers_util import run
url, tenants = sys.argv[1], sys.argv[2].split(",")
engine = build_engine(EngineConfig.from_kwargs(
    kv_cache_memory="256MiB", kv_host_memory="off", kv_disk_path="off", kv_redis_url=url,
    quantization="none",  # the float weights of the engine it shares the tier with
    kv_store_secret="a secret both engines share, long enough",
    kv_store_min_tokens=16), progress=False)
for tenant in tenants:
    out = run(engine, tenant=tenant)
    print(json.dumps({"tenant": tenant, "tokens": out.token_ids,
                      "loaded": out.num_loaded_tokens, "cached": out.num_cached_tokens}))
engine.close()
"""


@pytest.fixture(scope="module")
def reference(make_engine):
    return run(make_engine()).token_ids


@pytest.fixture
def redis_engine(tier_engine, redis_db):
    return lambda **kw: tier_engine(
        **{
            "kv_redis_url": redis_db.url,
            "kv_store_secret": "a secret both engines share, long enough",
            **kw,
        }
    )


def test_round_trip_through_redis(redis_engine, reference, redis_db):
    engine = redis_engine()
    assert run(engine).token_ids == reference
    evict_device(engine)
    out = run(engine)
    assert out.num_loaded_tokens == (out.num_prompt_tokens - 1) // 16 * 16
    assert out.token_ids == reference
    stats = engine.stats()
    assert stats.store.tiers["redis"].hits > 0 and stats.store.tiers["redis"].faults == 0
    keys = redis_db.client().keys("kvwise:kv:*")
    assert keys and all(0 < redis_db.client().ttl(k) <= 3600 for k in keys)


def test_second_process_shares_the_tier_within_a_tenant_only(redis_engine, reference, redis_db):
    engine = redis_engine()
    run(engine, tenant="alice")
    engine.flush()
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_ENGINE, redis_db.url, "bob,alice"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    bob, alice = (json.loads(line) for line in proc.stdout.strip().splitlines())
    assert bob["cached"] == 0 and bob["tokens"] == reference
    assert alice["loaded"] > 0 and alice["tokens"] == reference


def test_killed_redis_is_a_miss(redis_engine, reference, redis_db):
    engine = redis_engine(kv_redis_timeout=0.2)
    run(engine)
    evict_device(engine)
    redis_db.kill()
    t0 = time.perf_counter()
    out = run(engine)
    assert out.token_ids == reference and out.num_loaded_tokens == 0
    assert time.perf_counter() - t0 < 20
    engine.flush()  # the writes of this run fail too: counted, not raised
    assert engine.stats().store.tiers["redis"].faults >= 1
    redis_db.start()


def test_hung_redis_times_out_into_a_miss(redis_engine, reference, redis_db):
    engine = redis_engine(kv_redis_timeout=0.2)
    run(engine)
    evict_device(engine)
    pauser = redis_db.client()
    paused = threading.Thread(target=lambda: pauser.execute_command("CLIENT", "PAUSE", 1500, "ALL"))
    paused.start()
    paused.join()
    out = run(engine)
    assert out.token_ids == reference and out.num_loaded_tokens == 0
    assert engine.stats().store.tiers["redis"].faults >= 1
    time.sleep(1.6)  # let the pause end before the next test flushes the server


def test_retention_sets_a_long_ttl(redis_engine, redis_db):
    engine = redis_engine()
    run(engine, retention="24h")
    engine.flush()
    client = redis_db.client()
    ttls = [client.ttl(k) for k in client.keys("kvwise:kv:*")]
    assert ttls and min(ttls) > 23 * 3600


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_kv_round_trips_through_redis(redis_engine, make_engine, dtype):
    """A quantized pool stores its compact bytes in Redis and reads them back: the same greedy
    tokens as computing the prefix cold; an engine of another KV format finds nothing."""
    cold = run(make_engine(kv_cache_dtype=dtype))
    engine = redis_engine(kv_cache_dtype=dtype)
    run(engine)
    engine.flush()
    evict_device(engine)
    out = run(engine)
    assert out.num_loaded_tokens > 250 and out.token_ids == cold.token_ids
    redis_stats = engine.stats().store.tiers["redis"]
    spec = engine.runner.spec
    float_bytes = (
        out.num_loaded_tokens * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    )
    assert 0 < redis_stats.bytes_read < float_bytes / 3.5  # compact entries, not float32
    other = redis_engine(kv_cache_dtype="float32")
    assert run(other).num_loaded_tokens == 0
    assert other.stats().store.lookup_misses >= 1
