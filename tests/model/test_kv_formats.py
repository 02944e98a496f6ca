"""KV formats on the default model: a narrower or quantized pool holds more tokens in the same
memory, gives the same greedy tokens whether a prefix was computed cold, hit in the pool or
loaded from a tier, and never serves (or is served) another format's entries."""

from __future__ import annotations

import pytest
import torch

from tests.tiers_util import PROMPT, evict_device, run

pytestmark = pytest.mark.slow

FORMATS = ["bfloat16", "int8", "int4"]
PROMPT_A = PROMPT + " Which fruits are yellow? Answer with their numbers."  # ~470 tokens


@pytest.mark.parametrize("dtype", FORMATS)
def test_greedy_tokens_are_the_same_cold_from_the_pool_host_and_disk(tier_engine, tmp_path, dtype):
    engine = tier_engine(kv_cache_dtype=dtype, kv_host_memory="64MiB", kv_disk_path=str(tmp_path))
    cold = run(engine)
    assert cold.num_cached_tokens == 0
    pool = run(engine)
    assert pool.num_cached_tokens > 250 and pool.num_loaded_tokens == 0
    evict_device(engine)
    host = run(engine)
    assert host.num_loaded_tokens > 250
    assert engine.stats().store.tiers["host"].hits > 0
    engine.close()
    restarted = tier_engine(kv_cache_dtype=dtype, kv_disk_path=str(tmp_path))
    disk = run(restarted)
    assert disk.num_loaded_tokens > 250
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


def _int4_tokens(engine, prompt, max_tokens=16):
    from kvwise.types import SamplingParams

    request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_int4_staging_slots_are_released(make_engine, smollm2_int4):
    """Open blocks' full-precision keys live in staging slots until sealed or freed: after
    finished, aborted and preempted requests nothing stays behind."""
    from kvwise.types import SamplingParams

    engine = make_engine(loaded=smollm2_int4, kv_cache_memory="64MiB", kv_cache_dtype="int4")
    cache = engine.runner.kv_cache
    ids = [engine.add_request(PROMPT_A[: 200 + 37 * i], SamplingParams(max_tokens=40))
           for i in range(6)]  # fmt: skip
    for _ in range(5):
        engine.step()
    assert 1 <= len(cache.staging.open_blocks) <= 6 + 6  # an open block each (+ those sealed)
    engine.abort(ids[:3])
    while engine.has_unfinished():
        engine.step()
    engine.step()  # the step after the last frees its slots
    assert cache.staging.open_blocks == set()
    assert cache.staging.num_free == cache.staging.num_slots == cache.staged.shape[1]


def test_int4_preempted_requests_release_their_slots(make_engine, smollm2_int4):
    from kvwise.types import SamplingParams

    greedy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    prompts = [PROMPT_A[i * 150 : i * 150 + 500] for i in range(3)]  # ~150 tokens each
    engine = make_engine(loaded=smollm2_int4, kv_cache_memory="4MiB", kv_cache_dtype="int4")
    # blocks of 32 tokens: two prompts and a block of each answer fit, two answers do not
    assert engine.kv_manager.num_blocks == 18
    ids = [engine.add_request(p, greedy) for p in prompts]
    finished = {}
    while engine.has_unfinished():
        finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert engine.stats().num_preemptions > 0
    assert all(len(finished[i]) == 200 for i in ids)
    engine.step()
    assert engine.runner.kv_cache.staging.open_blocks == set()


def test_int4_engine_computes_what_eval_measures(make_engine, smollm2):
    """``kvwise eval --kv-cache-dtype int4`` runs the engine's own int4 pool and attention (the
    same kernels, worker/one_sequence.py): the engine's log-probability of its first answer
    token is eval's, to float32 rounding (float32 weights: the int4 weights' int8 activations
    would amplify that rounding).
    Chunked prefill and decodes are checked against a reference in
    tests/unit/test_kv_int4_sealing.py."""
    from kvwise.bench.evaluate import _hidden

    engine = make_engine(
        kv_cache_memory="64MiB", kv_cache_dtype="int4", enable_prefix_caching=False
    )  # each prompt in one chunk, as eval runs it
    deltas = []
    for prompt in (PROMPT_A[:1000], PROMPT_A, PROMPT[300:]):
        out = _int4_tokens(engine, prompt, max_tokens=1)
        ids = torch.tensor(out.prompt_token_ids)
        assert len(ids) % 32 and len(ids) > 200  # an open last block
        hidden = _hidden(smollm2, ids, "int4", 0, 32)
        logp = torch.log_softmax(smollm2.model.compute_logits(hidden[-1:]).float(), -1)[0]
        assert int(logp.argmax()) == out.token_ids[0]
        deltas.append(abs(float(logp[out.token_ids[0]]) - out.logprobs[0]))
        float_hidden = _hidden(smollm2, ids, "float32")
        assert (hidden - float_hidden).abs().max() > 1e-2  # the format does change the numbers
    assert max(deltas) < 1e-4, deltas  # measured: ~1e-5
