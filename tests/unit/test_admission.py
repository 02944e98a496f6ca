"""Admission without head-of-line blocking (issue 45, item 3), on the fake runner: a waiting
request that does not fit the pool yet no longer holds up the smaller ones behind it; after
``max_admission_skips`` admissions past it, it ages and nothing behind it goes first, so it
runs as the running ones finish; the look-ahead is bounded; outputs are the same as in FIFO
order; the counts reach ``EngineStats`` and its metrics."""

from __future__ import annotations

import pytest

from kvwise.config import EngineConfig, SchedulerConfig
from kvwise.core.admission import ADMISSION_LOOKAHEAD
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.request import Request
from kvwise.core.scheduler import Scheduler
from kvwise.core.stat_fields import metric_fields
from kvwise.engine.stats import EngineStats
from kvwise.types import SamplingParams
from kvwise.worker.fake_runner import FakeModelRunner
from tests.fakes import fake_engine

NUM_BLOCKS, BLOCK_SIZE = 12, 4


def make(**sched):
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, model_fingerprint="m")
    scheduler = Scheduler(SchedulerConfig(**sched), manager, max_model_len=1000)
    return scheduler, FakeModelRunner(NUM_BLOCKS, BLOCK_SIZE)


def req(rid: str, n: int, max_tokens: int, start: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, list(range(start, start + n)), params)


def step(scheduler, runner, outputs=None, order=None) -> list[str]:
    """One step; returns the ids it admitted (their first chunk scheduled)."""
    out = scheduler.schedule()
    new = [s.request_id for s in out.scheduled if s.start_pos == 0]
    if order is not None:
        order.extend(new)
    for update in scheduler.update(out, runner.execute(out)):
        if outputs is not None:
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
    return new


def start_long_decode(scheduler, runner) -> None:
    """Request "run": a 4-token prompt decoding for 30 steps (2 of the 12 blocks once it is
    admitted with a block of its answer); then "big" (40 tokens: 11 blocks) cannot fit."""
    scheduler.add_request(req("run", 4, max_tokens=30, start=0))
    assert step(scheduler, runner) == ["run"]
    scheduler.add_request(req("big", 40, max_tokens=2, start=100))


def test_a_small_request_is_admitted_past_a_big_one_that_does_not_fit():
    scheduler, runner = make()
    start_long_decode(scheduler, runner)
    scheduler.add_request(req("small", 3, max_tokens=2, start=500))
    assert step(scheduler, runner) == ["small"]
    assert [r.request_id for r in scheduler.waiting] == ["big"]
    assert scheduler.requests["big"].num_admission_skips == 1
    assert scheduler.num_admission_skips == 1 and scheduler.num_admission_aged == 0

    # strict FIFO (the behaviour before): "small" waits behind "big" until "run" is done
    scheduler, runner = make(max_admission_skips=0)
    start_long_decode(scheduler, runner)
    scheduler.add_request(req("small", 3, max_tokens=2, start=500))
    assert step(scheduler, runner) == []
    order: list[str] = []
    while scheduler.num_unfinished:
        step(scheduler, runner, order=order)
    assert order == ["big", "small"] and scheduler.num_admission_skips == 0


def test_an_aged_request_stops_the_bypass_and_runs():
    scheduler, runner = make(max_admission_skips=2)
    start_long_decode(scheduler, runner)
    order: list[str] = []
    for i in range(6):  # a small request every step from another tenant
        scheduler.add_request(req(f"small{i}", 3, max_tokens=2, start=500 + 10 * i))
        step(scheduler, runner, order=order)
    assert order == ["small0", "small1"]  # then "big" aged: the others wait behind it
    assert scheduler.requests["big"].num_admission_skips == 2
    assert scheduler.num_admission_skips == 2 and scheduler.num_admission_aged == 1
    while scheduler.num_unfinished:
        step(scheduler, runner, order=order)
    assert order == ["small0", "small1", "big"] + [f"small{i}" for i in range(2, 6)]
    assert scheduler.kv.pool.num_free_blocks == NUM_BLOCKS
    # each prompt looked up in the prefix cache once, however many steps it waited
    assert scheduler.kv.num_prefix_query_tokens == 4 + 40 + 6 * 3


def test_one_step_may_skip_a_request_only_up_to_its_bound():
    scheduler, runner = make(max_admission_skips=2)
    start_long_decode(scheduler, runner)
    for i in range(4):
        scheduler.add_request(req(f"small{i}", 3, max_tokens=2, start=500 + 10 * i))
    assert step(scheduler, runner) == ["small0", "small1"]
    assert scheduler.num_admission_aged == 1


def test_the_look_ahead_is_bounded():
    scheduler, runner = make()
    start_long_decode(scheduler, runner)
    for i in range(ADMISSION_LOOKAHEAD - 1):  # with "big": the whole look-ahead blocked
        scheduler.add_request(req(f"big{i}", 40, max_tokens=2, start=1000 + 50 * i))
    scheduler.add_request(req("small", 3, max_tokens=2, start=500))
    assert step(scheduler, runner) == []
    assert scheduler.num_admission_skips == 0


def test_no_bypass_when_admitting_on_the_first_chunk():
    scheduler, runner = make(admit_whole_prompts=False)
    scheduler.add_request(req("run", 4, max_tokens=30, start=0))
    step(scheduler, runner)
    scheduler.add_request(req("big", 44, max_tokens=2, start=100))  # its first chunk: 11 blocks
    scheduler.add_request(req("small", 3, max_tokens=2, start=500))
    assert step(scheduler, runner) == []
    assert scheduler.num_admission_skips == 0


def _outputs(**sched) -> dict[str, list[int]]:
    scheduler, runner = make(**sched)
    outputs: dict[str, list[int]] = {}
    scheduler.add_request(req("run", 4, max_tokens=30, start=0))
    step(scheduler, runner, outputs)
    scheduler.add_request(req("big", 40, max_tokens=5, start=100))
    for i in range(5):
        scheduler.add_request(req(f"small{i}", 3 + i, max_tokens=6, start=500 + 10 * i))
        step(scheduler, runner, outputs)
    while scheduler.num_unfinished:
        step(scheduler, runner, outputs)
        scheduler.kv.check_integrity()
    assert scheduler.num_preemptions == 0
    return outputs


def test_outputs_are_those_of_fifo_order():
    fifo, skipping = _outputs(max_admission_skips=0), _outputs()
    assert skipping == fifo and len(fifo) == 7
    assert all(len(tokens) in (5, 6, 30) for tokens in fifo.values())


@pytest.mark.parametrize("bad", [-1, "3", 1.5, True])
def test_max_admission_skips_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="max_admission_skips"):
        SchedulerConfig(max_admission_skips=bad)
    with pytest.raises(ValueError, match="max_admission_skips"):
        EngineConfig.from_kwargs(max_admission_skips=bad)


def test_the_counts_reach_the_engine_stats_and_metrics():
    names = {f.metric for f in metric_fields(EngineStats)}
    assert {
        "kvwise_admission_skips",
        "kvwise_admission_aged",
        "kvwise_oldest_waiting_seconds",
    } <= names
    engine = fake_engine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_admission_skips=1)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("abcd", params)
    engine.step()
    engine.add_request("x" * 40, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for text in ("ab", "cd"):
        engine.add_request(text, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert stats.num_admission_skips == 1 and stats.num_admission_aged == 1
    assert stats.num_waiting == 2 and stats.oldest_waiting_s > 0
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().oldest_waiting_s == 0.0
