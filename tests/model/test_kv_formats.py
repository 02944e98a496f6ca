"""KV formats on the default model: a narrower or quantized pool holds more tokens in the same
memory, gives the same greedy tokens whether a prefix was computed cold, hit in the pool or
loaded from a tier, and never serves (or is served) another format's entries."""

from __future__ import annotations

import pytest
import torch

from tests.tiers_util import evict_device, run

pytestmark = pytest.mark.slow

FORMATS = ["bfloat16", "int8", "int4"]


@pytest.mark.parametrize("dtype", FORMATS)
def test_greedy_tokens_are_the_same_cold_from_the_pool_host_and_disk(tier_engine, tmp_path, dtype):
    engine = tier_engine(kv_cache_dtype=dtype, kv_host_memory="64MiB", kv_disk_path=str(tmp_path))
    cold = run(engine)
    assert cold.num_cached_tokens == 0
    pool = run(engine)
    assert pool.num_cached_tokens > 300 and pool.num_loaded_tokens == 0
    evict_device(engine)
    host = run(engine)
    assert host.num_loaded_tokens > 300
    assert engine.stats().store.tiers["host"].hits > 0
    engine.close()
    restarted = tier_engine(kv_cache_dtype=dtype, kv_disk_path=str(tmp_path))
    disk = run(restarted)
    assert disk.num_loaded_tokens > 300
    assert restarted.stats().store.tiers["disk"].hits > 0
    assert cold.token_ids == pool.token_ids == host.token_ids == disk.token_ids


def test_pool_capacity_grows_with_the_format(make_engine):
    """Measured from the pool the engine built, at one kv_cache_memory (issue 12's targets:
    int8 >= 3.5x the tokens of float32, 4-bit >= 6x)."""
    tokens = {}
    for dtype in ("float32", "bfloat16", "int8", "int4"):
        engine = make_engine(kv_cache_memory="64MiB", kv_cache_dtype=dtype)
        tokens[dtype] = engine.kv_manager.num_blocks * engine.runner.spec.block_size
        assert engine.runner.kv_cache.num_bytes <= 64 * 2**20
    assert tokens["bfloat16"] >= 1.99 * tokens["float32"]
    assert tokens["int8"] >= 3.5 * tokens["float32"]
    assert tokens["int4"] >= 6 * tokens["float32"]


def test_another_formats_entries_are_misses(tier_engine, tmp_path):
    writer = tier_engine(kv_cache_dtype="int8", kv_disk_path=str(tmp_path))
    run(writer)
    writer.close()
    for dtype in ("float32", "int4"):
        reader = tier_engine(kv_cache_dtype=dtype, kv_disk_path=str(tmp_path))
        out = run(reader)
        store = reader.stats().store
        disk = store.tiers["disk"]
        assert out.num_loaded_tokens == 0 and out.num_prompt_tokens > 300
        assert disk.num_entries > 0  # the int8 entries are there...
        assert disk.hits == 0 and disk.faults == 0  # ...never read, never taken as corrupt
        assert store.lookup_misses == 1 and store.load_decisions == 0
        reader.close()


def test_int8_kv_is_stored_as_int8(make_engine):
    engine = make_engine(kv_cache_memory="64MiB", kv_cache_dtype="int8")
    run(engine)
    cache = engine.runner.kv_cache
    codes = cache.codes[0][0]
    assert codes.dtype == torch.int8 and int(codes.abs().amax()) == 127  # each row spans -127..127
    assert cache.spec.layout.endswith(".int8")
