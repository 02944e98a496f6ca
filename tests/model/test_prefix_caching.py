"""Prefix caching on the real model: hits never change the answer; tenants and salts never
share; multi-turn chat reuses the previous turn."""

import pytest
import torch

from kvwise.types import RequestOptions, SamplingParams
from kvwise.worker.last_rows import LastRows
from tests.hits import whole_hit

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
DOC = " ".join(
    f"Fact {i}: the {i}th lighthouse on the coast was built in {1800 + i}." for i in range(12)
)


def run(engine, prompt, params=GREEDY, **kw):
    rid = engine.add_request(prompt, params, RequestOptions(**kw))
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    engine.check_integrity()
    return result


@pytest.fixture(scope="module")
def cold(make_engine):
    """Reference outputs with prefix caching off."""
    engine = make_engine(enable_prefix_caching=False)
    return {p: run(engine, p).token_ids for p in (DOC, DOC + " And then", DOC[:200])}


def test_hits_do_not_change_greedy_output(make_engine, cold):
    engine = make_engine()
    first = run(engine, DOC)
    assert first.num_cached_tokens == 0 and first.token_ids == cold[DOC]
    # the whole prompt cached (256 tokens, 16 blocks): only its last token is computed
    again = run(engine, DOC)
    assert again.num_cached_tokens == again.num_prompt_tokens - 1
    assert again.token_ids == cold[DOC]
    # a longer prompt sharing the prefix
    longer = run(engine, DOC + " And then")
    assert longer.num_cached_tokens > 0 and longer.token_ids == cold[DOC + " And then"]
    # a prompt ending inside a cached block
    part = run(engine, DOC[:200])
    assert part.num_cached_tokens > 0 and part.token_ids == cold[DOC[:200]]
    stats = engine.stats()
    assert stats.kv.prefix_hit_tokens > 0 and 0 < stats.kv.prefix_hit_rate < 1


def test_revived_free_blocks_give_same_output(make_engine, cold):
    engine = make_engine()
    run(engine, DOC)
    assert engine.kv_manager.pool.num_cached_free_blocks > 0  # finished, freed, still cached
    revived = run(engine, DOC)
    assert revived.num_cached_tokens > 0 and revived.token_ids == cold[DOC]


def test_tenants_and_salts_never_share(make_engine):
    engine = make_engine()
    a = run(engine, DOC, tenant="alice")
    full_blocks = whole_hit(a.num_prompt_tokens)
    assert a.num_cached_tokens == 0
    assert run(engine, DOC, tenant="bob").num_cached_tokens == 0
    assert run(engine, DOC, tenant="alice").num_cached_tokens == full_blocks
    assert run(engine, DOC, tenant="alice", cache_salt="s1").num_cached_tokens == 0
    assert run(engine, DOC, tenant="alice", cache_salt="s1").num_cached_tokens == full_blocks


def test_public_prefix_shared_across_tenants(make_engine):
    system = [{"role": "system", "content": DOC}]
    engine = make_engine(public_prefix_min_tokens=64)
    n = engine.add_public_prefix(system)
    a = run(engine, system + [{"role": "user", "content": "Which is the 3rd?"}], tenant="a")
    b = run(engine, system + [{"role": "user", "content": "Which is the 5th?"}], tenant="b")
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == n // 64 * 64  # whole 64-token chunks of the system prompt


def test_multi_turn_chat_reuses_previous_turn(make_engine):
    """Turn n+1 hits every full block of turn n's prompt and answer.

    This holds when the chat template re-renders history exactly as it was generated;
    SmolLM2's template does (the answer's tokens round-trip through its text).
    """
    engine = make_engine()
    params = SamplingParams(max_tokens=40, temperature=0)
    messages = [{"role": "user", "content": "Name three colours."}]
    previous_len = None
    for turn in range(3):
        out = run(engine, messages, params)
        if previous_len is not None:
            # the last answer token was sampled but never computed, so it holds no KV
            assert out.num_cached_tokens == (previous_len - 1) // 16 * 16, (
                f"turn {turn}: {out.num_cached_tokens} cached of {previous_len} previous tokens"
            )
        previous_len = out.num_prompt_tokens + len(out.token_ids)
        retokenized = engine.tokenizer.encode(out.text, add_special_tokens=False)
        assert retokenized == out.token_ids[: len(retokenized)], "answer does not round-trip"
        messages += [
            {"role": "assistant", "content": out.text},
            {"role": "user", "content": ["And three more.", "Thanks, one more?"][turn % 2]},
        ]


def test_retention_keeps_prefix_through_pressure(make_engine):
    engine = make_engine(kv_cache_memory="32MiB")  # 45 blocks; one tenant may keep 22
    kept = run(engine, DOC, retention="1h")
    assert engine.stats().kv.blocks_kept > 0
    for i in range(6):  # unrelated traffic (17 blocks each) that evicts plain LRU blocks
        run(engine, f"Unrelated prompt number {i}: " + "lorem ipsum " * 20)
    again = run(engine, DOC)
    assert again.num_cached_tokens == whole_hit(kept.num_prompt_tokens)
    assert again.token_ids == kept.token_ids
    # the same traffic without retention loses the prefix
    plain = make_engine(kv_cache_memory="32MiB")
    run(plain, DOC)
    for i in range(6):
        run(plain, f"Unrelated prompt number {i}: " + "lorem ipsum " * 20)
    assert run(plain, DOC).num_cached_tokens < again.num_cached_tokens


def test_public_system_prompt_from_config(make_engine):
    engine = make_engine(public_system_prompts=(DOC,), public_prefix_min_tokens=64)
    question = [{"role": "user", "content": "Which is the 4th?"}]
    run(engine, [{"role": "system", "content": DOC}] + question, tenant="a")
    b = run(engine, [{"role": "system", "content": DOC}] + question, tenant="b")
    assert b.num_cached_tokens > 0 and b.num_cached_tokens % 64 == 0


def _aligned_prompt(engine, blocks: int = 6) -> list[int]:
    ids = engine.tokenizer.encode(DOC)
    return ids[: blocks * engine.kv_manager.block_size]


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "int4"])
def test_a_prompt_cached_whole_computes_its_last_token_alone(make_engine, kv):
    engine = make_engine(kv_cache_dtype=kv)
    engine.runner.last_rows = LastRows(0)  # no kept last rows: the row is computed each time
    ids = _aligned_prompt(engine)
    cold_tokens = run(make_engine(kv_cache_dtype=kv, enable_prefix_caching=False), ids).token_ids
    assert run(engine, ids).token_ids == cold_tokens
    rows, execute = [], engine.runner.execute
    engine.runner.execute = lambda out, *a: (
        rows.append(sum(s.num_tokens for s in out.scheduled)) or execute(out, *a)
    )
    again = run(engine, ids)
    engine.runner.execute = execute
    assert again.token_ids == cold_tokens
    if kv == "int4":  # sealed keys: a whole hit is not offered, the last block is recomputed
        bs = engine.kv_manager.block_size
        assert again.num_cached_tokens == len(ids) - bs and rows[0] == bs
    else:
        assert again.num_cached_tokens == len(ids) - 1 and rows[0] == 1
    # beside other requests in one batch: a decode, a cold prefill, another whole hit
    other = ids[:40] + [ids[1]] * 9
    refs = {tuple(p): run(make_engine(kv_cache_dtype=kv, enable_prefix_caching=False), p)
            for p in (other, ids)}  # fmt: skip
    rids = [engine.add_request(p, GREEDY) for p in (other, ids, ids)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.check_integrity()
    for rid, p in zip(rids, (other, ids, ids), strict=True):
        assert done[rid].token_ids == refs[tuple(p)].token_ids


@pytest.mark.parametrize("paged_kernel", [True, False])
def test_a_whole_hit_leaves_the_cached_block_unwritten(make_engine, paged_kernel):
    """The last row reads its K/V from the pool: poisoned there, it stays poisoned (a row that
    were written would overwrite it) and the answer sees the poison; the paged kernel's path
    and the torch path alike."""
    from kvwise.worker.attention_backend import make_attention

    engine = make_engine()
    engine.runner.last_rows = LastRows(0)  # the row is computed, not taken from a kept one
    if not paged_kernel:
        a = engine.runner.attention
        engine.runner.attention = make_attention(a.kv_cache, a.num_heads, a.head_dim,
                                                     paged_kernel=False, layers=a.layers,
                                                     places=a.places)  # fmt: skip
    ids = _aligned_prompt(engine)
    cold = run(engine, ids)
    (block,) = [engine.kv_manager.pool.get_cached_block(h)
                for h in engine.kv_manager.hasher.chain(ids)][-1:]  # fmt: skip
    cache = engine.runner.kv_cache
    poison = torch.full_like(cache.kv[:, :, block.block_id, 15], 50.0)
    cache.kv[:, :, block.block_id, 15] = poison
    again = run(engine, ids, SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    assert again.num_cached_tokens == len(ids) - 1
    assert torch.equal(cache.kv[:, :, block.block_id, 15], poison)
    assert again.logprobs[0] != pytest.approx(cold.logprobs[0], abs=1e-3)


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_a_whole_hit_samples_from_the_kept_last_row(make_engine, kv):
    """A block-aligned prompt computed once keeps its last row's final hidden state; its whole
    hits then run no model row for their first token. The tokens and logprobs are the same
    bits as those of the first run and of a whole hit that computes the row again."""
    engine = make_engine(kv_cache_dtype=kv)
    ids = _aligned_prompt(engine)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    first = run(engine, ids, params)
    assert len(engine.runner.last_rows) == 1 and engine.stats().num_last_rows_reused == 0
    rows, forward = [], engine.runner._forward
    engine.runner._forward = lambda out, *a: rows.append(len(out.scheduled)) or forward(out, *a)
    again = run(engine, ids, params)
    engine.runner._forward = forward
    assert again.num_cached_tokens == len(ids) - 1
    assert engine.stats().num_last_rows_reused == 1
    assert len(rows) == len(again.token_ids) - 1  # the decode steps only: no step for the hit
    engine.runner.last_rows = LastRows()  # forgotten: the hit computes its row again
    recomputed = run(engine, ids, params)
    assert engine.stats().num_last_rows_reused == 1
    for out in (again, recomputed):
        assert out.token_ids == first.token_ids
        assert out.logprobs == first.logprobs  # exact: the same bits
        assert out.top_logprobs == first.top_logprobs


def test_kept_last_rows_stay_in_their_namespace_and_batch(make_engine):
    """Another tenant or salt with the same prompt finds no kept row (its hashes descend from
    another root); a kept row serves its hit in a step beside a decode and a whole hit that
    computes its row (none kept for it), each answer the one it gets alone."""
    engine = make_engine()
    ids = _aligned_prompt(engine)
    alone = run(engine, ids, tenant="alice")
    assert run(engine, ids, tenant="bob").num_cached_tokens == 0
    assert run(engine, ids, tenant="alice", cache_salt="s").num_cached_tokens == 0
    assert engine.stats().num_last_rows_reused == 0
    other, shorter = ids[:40] + [ids[1]] * 9, ids[: 4 * engine.kv_manager.block_size]
    refs = {tuple(p): run(make_engine(enable_prefix_caching=False), p).token_ids
            for p in (other, shorter)}  # fmt: skip
    alice = RequestOptions(tenant="alice")
    rids = [engine.add_request(other, GREEDY, alice)]
    engine.step()  # its prefill: it decodes in the next step
    rids += [engine.add_request(p, GREEDY, alice) for p in (ids, shorter)]
    steps = []
    execute = engine.runner.execute
    engine.runner.execute = lambda out, *a: steps.append(out.scheduled) or execute(out, *a)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.runner.execute = execute
    engine.check_integrity()
    assert [s.request_id for s in steps[0]] == rids  # one step: the decode and both hits
    assert engine.stats().num_last_rows_reused == 1  # ids' row was kept, shorter's was not
    assert done[rids[0]].token_ids == refs[tuple(other)]
    assert done[rids[1]].token_ids == alone.token_ids
    assert done[rids[2]].token_ids == refs[tuple(shorter)]
    assert done[rids[1]].num_cached_tokens == len(ids) - 1
    assert done[rids[2]].num_cached_tokens == len(shorter) - 1
