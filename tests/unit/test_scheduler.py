"""Scheduler and KV cache manager with a fake runner: exact block ids, chunking, preemption."""

import pytest

from kvwise.config import SchedulerConfig
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.request import Request
from kvwise.core.scheduler import Scheduler
from kvwise.types import FinishReason, SamplingParams
from kvwise.worker.fake_runner import FakeModelRunner

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def make(num_blocks=16, block_size=4, caching=True, kv=True, **sched):
    manager = KVCacheManager(num_blocks, block_size, enable_caching=caching, model_fingerprint="m")
    scheduler = Scheduler(SchedulerConfig(**sched), manager, max_model_len=1000, enable_kv_cache=kv)
    return scheduler, manager, FakeModelRunner(num_blocks, block_size)


def req(rid, n, max_tokens=4, start=0, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, list(range(start, start + n)), params, **kw)


def run_all(scheduler, runner, check=None):
    outputs = {}
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        for update in scheduler.update(out, runner.execute(out)):
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        if check:
            check()
    return outputs


def test_exact_block_tables_for_two_requests():
    scheduler, manager, runner = make()
    scheduler.add_request(req("a", 6))
    scheduler.add_request(req("b", 3, start=100))
    out = scheduler.schedule()
    assert [(s.request_id, s.start_pos, s.block_ids, s.sample) for s in out.scheduled] == [
        ("a", 0, [0, 1], True),
        ("b", 0, [2], True),
    ]
    scheduler.update(out, runner.execute(out))
    out = scheduler.schedule()  # decodes: a at position 6 fits block 1; b at 3 fits block 2
    assert [(s.request_id, s.start_pos, s.block_ids) for s in out.scheduled] == [
        ("a", 6, [0, 1]),
        ("b", 3, [2]),
    ]
    scheduler.update(out, runner.execute(out))
    out = scheduler.schedule()  # b reaches position 4: a new block
    assert [(s.request_id, s.block_ids) for s in out.scheduled] == [("a", [0, 1]), ("b", [2, 3])]


def test_chunked_prefill_shares_step_with_decode():
    scheduler, manager, runner = make(max_num_batched_tokens=8, prefill_chunk_size=4)
    scheduler.add_request(req("short", 2, max_tokens=5))
    out = scheduler.schedule()
    scheduler.update(out, runner.execute(out))
    scheduler.add_request(req("long", 10, start=50))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_tokens, s.sample) for s in out.scheduled] == [
        ("short", 1, True),
        ("long", 4, False),
    ]
    scheduler.update(out, runner.execute(out))
    out = scheduler.schedule()
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in out.scheduled] == [
        ("short", 3, 1),
        ("long", 4, 4),
    ]


def test_max_num_seqs_caps_running():
    scheduler, manager, runner = make(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(req(f"r{i}", 3, start=10 * i))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_preemption_frees_newest_and_recomputes_identically():
    # reference: plenty of blocks
    scheduler, manager, runner = make(num_blocks=64)
    for i in range(3):
        scheduler.add_request(req(f"r{i}", 7, max_tokens=14, start=10 * i))
    expected = run_all(scheduler, runner)

    # two are admitted (their prompts and a block each fit); their answers outgrow the pool
    scheduler, manager, runner = make(num_blocks=8)
    for i in range(3):
        scheduler.add_request(req(f"r{i}", 7, max_tokens=14, start=10 * i))
    got = run_all(scheduler, runner, check=manager.check_integrity)
    assert scheduler.num_preemptions > 0
    assert got == expected
    assert manager.pool.num_free_blocks == 8


def test_preempts_newest_first():
    scheduler, manager, runner = make(num_blocks=4, block_size=2)
    scheduler.add_request(req("old", 2, max_tokens=10))
    scheduler.add_request(req("new", 2, max_tokens=10, start=20))
    out = scheduler.schedule()  # each prompt and a block of its answer fit: both admitted
    assert [s.block_ids for s in out.scheduled] == [[0], [1]]
    for _ in range(3):  # positions 2 (a block each), 3
        scheduler.update(out, runner.execute(out))
        out = scheduler.schedule()
    assert out.preempted_ids == ["new"]  # position 4 needs a third block for "old"
    assert [(s.request_id, s.block_ids) for s in out.scheduled] == [("old", [0, 2, 3])]
    assert scheduler.waiting[0].request_id == "new"
    assert scheduler.waiting[0].num_computed_tokens == 0


def test_a_request_waits_until_its_whole_prompt_fits():
    """Admitted on its first chunk, "b" would take the blocks "a"'s prompt still needs and one
    of them would be preempted: it waits until the pool holds its whole prompt beside the rest
    of "a"'s (and a block of each answer), and nothing is preempted."""
    scheduler, manager, runner = make(num_blocks=10, prefill_chunk_size=4, max_num_batched_tokens=8)
    scheduler.add_request(req("a", 20, max_tokens=3))
    scheduler.add_request(req("b", 16, max_tokens=3, start=100))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 4)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    scheduler.update(out, runner.execute(out))
    got = run_all(scheduler, runner, check=manager.check_integrity)
    assert scheduler.num_preemptions == 0
    assert sorted(got) == ["a", "b"] and manager.pool.num_free_blocks == 10

    # admitted on its first chunk (admit_whole_prompts=False), b runs at once and one of the
    # two is preempted
    scheduler, manager, runner = make(
        num_blocks=10, prefill_chunk_size=4, max_num_batched_tokens=8, admit_whole_prompts=False
    )
    scheduler.add_request(req("a", 20, max_tokens=3))
    scheduler.add_request(req("b", 16, max_tokens=3, start=100))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 4), ("b", 4)]
    scheduler.update(out, runner.execute(out))
    assert sorted(run_all(scheduler, runner, check=manager.check_integrity)) == ["a", "b"]
    assert scheduler.num_preemptions > 0


def test_admit_whole_prompts_must_be_a_bool():
    with pytest.raises(ValueError, match="admit_whole_prompts"):
        SchedulerConfig(admit_whole_prompts="yes")


def test_cache_disabled_recomputes_everything_but_same_output():
    scheduler, manager, runner = make(caching=False)
    scheduler.add_request(req("a", 5, max_tokens=6))
    expected = run_all(scheduler, runner)
    projected_cached = runner.num_tokens_computed

    scheduler, manager, runner = make(caching=False, kv=False)
    scheduler.add_request(req("a", 5, max_tokens=6))
    assert run_all(scheduler, runner) == expected
    # with the cache: 5 + 5 tokens; without: 5 + 6 + 7 + 8 + 9 + 10
    assert projected_cached == 10
    assert runner.num_tokens_computed == 45


def test_prefix_hit_reuses_blocks_and_matches_output():
    scheduler, manager, runner = make()
    scheduler.add_request(req("a", 10, max_tokens=3))
    first = run_all(scheduler, runner)
    scheduler.add_request(req("b", 10, max_tokens=3))
    out = scheduler.schedule()
    # 10 tokens -> 2 full blocks cached; the hit starts computing at position 8
    assert out.scheduled[0].start_pos == 8
    assert scheduler.requests["b"].num_cached_tokens == 8
    second = {"b": []}
    for u in scheduler.update(out, runner.execute(out)):
        second["b"] += u.new_token_ids
    second["b"] += run_all(scheduler, runner).get("b", [])
    assert second["b"] == first["a"]


def test_whole_prompt_cached_still_computes_last_token():
    scheduler, manager, runner = make()
    scheduler.add_request(req("a", 8, max_tokens=1))
    run_all(scheduler, runner)
    scheduler.add_request(req("b", 8, max_tokens=1))
    out = scheduler.schedule()
    assert (out.scheduled[0].start_pos, out.scheduled[0].num_tokens) == (4, 4)


def test_admission_errors_name_the_field():
    scheduler, manager, runner = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        scheduler.add_request(req("big", 8))  # the pool holds 8 tokens
    scheduler.max_model_len = 5
    with pytest.raises(ValueError, match="context"):
        scheduler.add_request(req("long", 5))
    with pytest.raises(ValueError, match="prompt"):
        Request("empty", [], GREEDY)


def test_abort_frees_blocks():
    scheduler, manager, runner = make()
    scheduler.add_request(req("a", 9, max_tokens=50))
    out = scheduler.schedule()
    scheduler.update(out, runner.execute(out))
    assert manager.pool.num_used_blocks == 3
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    assert manager.pool.num_used_blocks == 0
    assert scheduler.num_unfinished == 0
    manager.check_integrity()


def test_request_outgrowing_pool_alone_finishes_with_length():
    scheduler, manager, runner = make(num_blocks=2, block_size=4)
    scheduler.add_request(req("a", 6, max_tokens=50))
    request = scheduler.requests["a"]
    finished = []
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        finished += [u.request for u in scheduler.update(out, runner.execute(out)) if u.finished]
    assert finished == [request]
    assert request.finish_reason is FinishReason.LENGTH
    assert request.num_computed_tokens == 8  # the whole pool; its last sample needs no slot
    assert request.num_tokens == 9
    assert manager.pool.num_free_blocks == 2
