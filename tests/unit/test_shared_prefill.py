"""One prefill for many copies of a prompt (n choices, or the same prompt sent twice at once):
a waiting request whose prompt's blocks a running request is computing now waits for them,
then hits them (``KVCacheManager.shared_prefill``), on the fake runner: the same outputs as
each alone, the prompt's tokens computed once, the blocks held once while the prefill runs;
no wait for a short shared part, another tenant, prompt logprobs or with caching off."""

from __future__ import annotations

from kvwise.types import RequestOptions, SamplingParams
from tests.fakes import fake_engine

PROMPT = (
    "the quick brown fox jumps over the lazy dog, " * 6
)  # 270 bytes: 67 full blocks of 4, in 5 chunks of 64
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _run(engine, prompts, options=None):
    ids = [engine.add_request(p, PARAMS, options[i] if options else None)
           for i, p in enumerate(prompts)]  # fmt: skip
    done, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak = max(peak, engine.kv_manager.pool.num_used_blocks)
    return [done[i] for i in ids], peak


def test_copies_wait_for_the_first_prefill_and_hit_it():
    alone, alone_peak = _run(
        fake_engine(num_blocks=512, max_num_batched_tokens=64, prefill_chunk_size=64), [PROMPT]
    )
    engine = fake_engine(num_blocks=512, max_num_batched_tokens=64, prefill_chunk_size=64)
    outs, peak = _run(engine, [PROMPT] * 4)
    assert all(o.token_ids == alone[0].token_ids for o in outs)
    assert engine.scheduler.num_prefill_waits > 0
    full = (len(outs[0].prompt_token_ids) - 1) // 4 * 4
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens == full for o in outs[1:])
    assert engine.runner.num_tokens_computed < 2 * alone[0].num_prompt_tokens
    assert peak < 2 * alone_peak  # the prompt's blocks held once (plus each one's own tail)


def test_no_wait_where_nothing_worth_sharing():
    engine = fake_engine(num_blocks=512, max_num_batched_tokens=64, prefill_chunk_size=64)
    _run(engine, [PROMPT, PROMPT[:40] + "x" * 230])  # a short shared part: computed twice
    _run(
        engine,
        [PROMPT + "a", PROMPT + "b"],
        [RequestOptions(tenant="a"), RequestOptions(tenant="b")],
    )
    assert engine.scheduler.num_prefill_waits == 0
    off = fake_engine(
        num_blocks=512,
        max_num_batched_tokens=64,
        prefill_chunk_size=64,
        enable_prefix_caching=False,
    )
    _run(off, [PROMPT] * 2)
    assert off.scheduler.num_prefill_waits == 0
