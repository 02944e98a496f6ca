"""A row fails alone (issue 45, item 2): when sampling, the grammar or detokenizing fails for one
request of a step, that request ends with ``FinishReason.ERROR`` (its blocks freed, its async
stream raising ``EngineStepError``) and the step's other requests go on with exactly the tokens
they produce alone. Also the sampling bounds that keep a row's logits finite."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvwise.engine.async_engine import AsyncEngine
from kvwise.errors import EngineStepError, InvalidRequest
from kvwise.types import MIN_REPETITION_PENALTY, FinishReason, SamplingParams
from tests.fakes import fake_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [f"tenant {i} asks: {'abc' * i}?" for i in range(16)]
VICTIM = 5  # the row that fails
FAIL_AT_STEP = 3


class FailOneRow:
    """A runner wrapper whose ``FAIL_AT_STEP``-th step sampling the victim reports the victim's row as failed (as
    the real sampler does when a row's draw raises): its token is not in ``sampled``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.victim: str | None = None
        self.num_steps = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, sched_out, *args, **kwargs):
        out = self.inner.execute(sched_out, *args, **kwargs)
        self.num_steps += self.victim in out.sampled
        if self.num_steps == FAIL_AT_STEP and self.victim in out.sampled:
            del out.sampled[self.victim]
            out.failed[self.victim] = "sampling failed: injected"
        return out


def _alone() -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        engine = fake_engine(num_blocks=256)
        request_id = engine.add_request(prompt, GREEDY)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id == request_id:
                    outs.append(out.token_ids)
    return outs


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    return _alone()


def _run_batch(engine, ids) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == set(ids)
    return done


def _check(engine, done, ids, alone, error_word: str) -> None:
    victim = done[ids[VICTIM]]
    assert victim.finish_reason is FinishReason.ERROR
    assert error_word in victim.error
    for i, request_id in enumerate(ids):
        if i != VICTIM:
            assert done[request_id].finish_reason is FinishReason.LENGTH
            assert done[request_id].token_ids == alone[i], f"row {i} changed"
    engine.check_integrity()
    assert engine.kv_manager.pool.num_used_blocks == 0  # the victim's blocks too


def test_a_failed_sampling_row_ends_alone_and_the_other_15_are_untouched(alone):
    engine = fake_engine(num_blocks=256, wrap_runner=FailOneRow)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.runner.victim = ids[VICTIM]
    done = _run_batch(engine, ids)
    _check(engine, done, ids, alone, "sampling failed")
    assert len(done[ids[VICTIM]].token_ids) < GREEDY.max_tokens


def test_a_failed_detokenizer_ends_its_request_alone(alone):
    engine = fake_engine(num_blocks=256)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    state = engine.outputs._states[ids[VICTIM]]
    calls = []

    def broken_add(token_id: int) -> str:
        calls.append(token_id)
        if len(calls) == FAIL_AT_STEP:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return ""

    state.text_stop.detokenizer.add = broken_add
    done = _run_batch(engine, ids)
    _check(engine, done, ids, alone, "detokenizing failed")


def test_a_failed_grammar_ends_its_request_alone(alone):
    class BrokenGrammar:
        finished = False

        def bitmask(self) -> bytes:
            raise RuntimeError("injected grammar failure")

        def accept(self, token_id: int) -> bool:
            return True

    engine = fake_engine(num_blocks=256)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.scheduler.requests[ids[VICTIM]].grammar = BrokenGrammar()
    done = _run_batch(engine, ids)
    _check(engine, done, ids, alone, "grammar failed")


def test_async_engine_fails_only_the_failed_rows_stream(alone):
    engine = fake_engine(num_blocks=256, wrap_runner=FailOneRow)
    engine.runner.victim = "victim"
    async_engine = AsyncEngine(engine)

    async def main():
        streams = [
            await async_engine.add_request(p, GREEDY, request_id="victim" if i == VICTIM else None)
            for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(*(_drain(s) for s in streams))

    async_engine.start()
    try:
        results = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert isinstance(results[VICTIM], EngineStepError)
    assert "sampling failed: injected" in str(results[VICTIM])
    for i, result in enumerate(results):
        if i != VICTIM:
            assert result == alone[i], f"row {i} changed"


async def _drain(stream):
    last = None
    try:
        async for out in stream:
            last = out
    except EngineStepError as exc:
        return exc
    return last.token_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
        ("repetition_penalty", 0.0),
        ("temperature", math.inf),
        ("presence_penalty", math.inf),
        ("frequency_penalty", -math.inf),
        ("top_p", math.nan),
        ("min_p", math.inf),
    ],
)
def test_values_that_could_overflow_a_row_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_must_be_finite():
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias={3: math.inf})


def test_the_bounds_themselves_are_accepted():
    SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY, temperature=1e-6)
    SamplingParams(repetition_penalty=10, presence_penalty=-2, frequency_penalty=2, min_p=1)
