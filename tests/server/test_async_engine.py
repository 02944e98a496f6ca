"""AsyncEngine on the tiny model: one loop thread, per-request streams, abort on cancel,
bounded queue, a failing step, shutdown. The engine is built around a ``ControlledRunner``:
tests slow its steps or make one fail through it, never by patching."""

from __future__ import annotations

import asyncio

import pytest

from kvwise.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
)
from kvwise.types import FinishReason, SamplingParams
from tests.fakes import ControlledRunner

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(make_tiny_engine):
    return make_tiny_engine(max_num_seqs=2, max_waiting=4, wrap_runner=ControlledRunner)


@pytest.fixture
def runner(engine) -> ControlledRunner:
    return engine.runner


@pytest.fixture
def async_engine(engine, runner):
    async_engine = AsyncEngine(engine, retry_after_s=3, close_engine=False)  # engine reused
    async_engine.start()
    yield async_engine
    async_engine.shutdown()
    runner.reset()  # no delay, no planned failure: the next test starts as this one did
    engine.check_integrity()
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_concurrent_generate_matches_sequential(async_engine):
    prompts = ["one two three", "the cat sat on", "a b c d e f", "hello"]

    async def run_one(prompt):
        outs = [out async for out in async_engine.generate(prompt, GREEDY)]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        return outs[-1].token_ids

    async def main():
        together = await asyncio.gather(*(run_one(p) for p in prompts))
        alone = [await run_one(p) for p in prompts]
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone and all(len(ids) == 8 for ids in together)
    assert async_engine.call_sync(lambda e: e.has_unfinished()) is False


def test_cancel_aborts_and_frees_blocks(async_engine, runner):
    runner.delay_s = 0.01
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        seen = []

        async def consume():
            async for out in async_engine.generate("a long story " * 10, params):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        assert await async_engine.call(lambda e: e.kv_manager.pool.num_used_blocks) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the abort is queued before this call, so it has run when the call returns
        return await async_engine.call(lambda e: (e.kv_manager.pool.num_used_blocks, e.stats()))

    used, stats = asyncio.run(main())
    assert used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_admission_errors_surface_before_output(async_engine, runner):
    runner.delay_s = 0.02
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="^prompt: "):
            await async_engine.add_request("", GREEDY)
        with pytest.raises(ValueError, match="do not fit"):
            await async_engine.add_request(list(range(300)), GREEDY)
        # max_num_seqs=2 running + max_waiting=4 waiting, then the queue is full
        streams = [await async_engine.add_request(f"prompt {i}", long) for i in range(2)]
        while async_engine.stats().num_running < 2:
            await asyncio.sleep(0.01)
        streams += [await async_engine.add_request(f"waiting {i}", long) for i in range(4)]
        with pytest.raises(QueueFullError) as info:
            await async_engine.add_request("one too many", long)
        assert info.value.retry_after_s == 3
        for stream in streams:
            stream.close()
        return await async_engine.call(lambda e: e.kv_manager.pool.num_used_blocks)

    assert asyncio.run(main()) == 0


def test_failed_step_fails_requests_in_flight_and_loop_goes_on(async_engine, runner):
    runner.fail_step(after=2, message="boom")  # the third step from now: mid-stream

    async def main():
        outs = []
        with pytest.raises(EngineStepError, match="boom"):
            async for out in async_engine.generate("hello there", GREEDY):
                outs.append(out)
        assert len(outs) == 2  # the two steps before the failure each gave a token
        outs = [out async for out in async_engine.generate("hello again", GREEDY)]
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.finish_reason is FinishReason.LENGTH
    assert async_engine.is_running


def test_shutdown_ends_open_streams(async_engine, runner):
    runner.delay_s = 0.01
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        stream = await async_engine.add_request("never finishes", params)
        await stream.__anext__()
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("after", params)

    asyncio.run(main())
    assert not async_engine.is_running


def test_the_idle_audit_waits_until_the_outputs_are_delivered(engine):
    """The pool's audit (it holds the GIL ~1 ms on a real pool) runs once the loop has been idle
    ``idle_audit_delay_s``, not between the last step and the delivery of its outputs."""
    async_engine = AsyncEngine(engine, close_engine=False, idle_audit_delay_s=1.0)
    async_engine.start()
    try:

        async def main():
            before = async_engine.stats().kv_integrity_checks
            outs = [out async for out in async_engine.generate("one two", GREEDY)]
            at_delivery = async_engine.stats().kv_integrity_checks
            await asyncio.sleep(1.5)
            return outs[-1].finished, before, at_delivery, async_engine.stats().kv_integrity_checks

        finished, before, at_delivery, later = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert finished and at_delivery == before and later == before + 1
