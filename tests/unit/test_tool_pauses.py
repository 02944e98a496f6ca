"""The tool's pause on the fake runner: a turn marked as waiting for a tool keeps its blocks
in the pool through pressure that evicts every unkept block, so the turn with the tool's
result finds them (counted as resumed from the pool); without the pause the same pressure
loses them; a pause not resumed within pause_s is forgotten; an unknown turn keeps nothing."""

from __future__ import annotations

from kvwise.types import SamplingParams
from tests.fakes import fake_engine, run_all

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TURN = list(range(1, 61))  # 60 tokens: 15 blocks of 4


def _run(engine, prompts):
    return run_all(engine, prompts, PARAMS)


def _conversation(pause: bool):
    engine = fake_engine(num_blocks=48, block_size=4)
    first = _run(engine, [TURN])[0]
    kept = engine.tool_pause(first.request_id) if pause else 0
    # pressure: other prompts that need every unkept block of the pool
    _run(engine, [[200 + i] * 100 for i in range(3)])
    result = TURN + first.token_ids + [7, 7, 7, 7]  # the tool's result appended
    second = _run(engine, [result])[0]
    return engine, first, kept, second


def test_a_paused_turn_survives_pool_pressure_and_is_resumed():
    engine, first, kept, second = _conversation(pause=True)
    full = (len(TURN) + len(first.token_ids) - 1) // 4 * 4
    assert kept == full
    assert second.num_cached_tokens >= full
    stats = engine.stats()
    assert stats.tool_pauses == 1 and stats.tool_resumes == 1
    assert stats.tool_resumed_device_tokens == full and stats.tool_recomputed_tokens == 0
    _, _, _, lost = _conversation(pause=False)  # the check can fail: unkept, it is evicted
    assert lost.num_cached_tokens < full


def test_expired_and_unknown_pauses():
    engine = fake_engine(num_blocks=48, block_size=4)
    assert engine.tool_pause("no-such-turn") == 0
    first = _run(engine, [TURN])[0]
    engine.tool_pauses.pause_s = 0.0
    engine.tool_pause(first.request_id)
    _run(engine, [TURN + first.token_ids + [1]])
    assert engine.stats().tool_resumes == 0 and engine.tool_pauses.counts.expired == 1


def test_a_prompt_that_parts_ways_inside_the_answer_still_resumes_the_pause():
    """The next turn may write the call back with other tokens than the model generated: it
    resumes the pause by the prefix it repeats (the whole prompt, part of the answer); another
    conversation that shares only the start of the prompt, or the same prompt sent again,
    resumes nothing."""
    engine = fake_engine(num_blocks=64, block_size=4)
    first = _run(engine, [TURN])[0]
    assert engine.tool_pause(first.request_id) > len(TURN)
    _run(engine, [TURN[:40] + [100 + i for i in range(30)]])  # shares 10 of its 15 blocks
    assert engine.stats().tool_resumes == 0
    _run(engine, [TURN])  # the paused turn's prompt sent again: not its tool's result
    assert engine.stats().tool_resumes == 0
    rewritten = TURN + first.token_ids[:2] + [9] * 6 + [7, 7, 7, 7]  # parts in block 15
    second = _run(engine, [rewritten])[0]
    stats = engine.stats()
    assert second.num_cached_tokens >= len(TURN)
    assert stats.tool_resumes == 1
    assert stats.tool_resumed_device_tokens == len(TURN) and stats.tool_recomputed_tokens == 0
    _run(engine, [rewritten])  # a pause is resumed once
    assert engine.stats().tool_resumes == 1
