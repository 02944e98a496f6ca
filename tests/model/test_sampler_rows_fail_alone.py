"""A row fails alone, on the default model (issue 45, item 2): the sampler keeps a row's logits
finite whatever its parameters, reports a row whose draw fails instead of raising for the
whole step, and the engine ends that request alone while the other 15 rows of the step keep
exactly the tokens they produce alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvwise.types import FinishReason, SamplingParams
from kvwise.worker import sampler

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DOOMED = SamplingParams(max_tokens=6, temperature=0.7, seed=45, ignore_eos=True)
PROMPTS = [f"Fact {i}: the number {i * 7} is" for i in range(16)]
VICTIM = 9


def _unchecked(params: SamplingParams, **changes) -> SamplingParams:
    """``params`` with values validation now refuses (what an older server let through)."""
    params = dataclasses.replace(params)
    for name, value in changes.items():
        object.__setattr__(params, name, value)
    return params


def test_a_tiny_repetition_penalty_cannot_overflow_its_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator) * 5  # (S, V)
    tiny = _unchecked(SamplingParams(temperature=1.0, seed=1), repetition_penalty=1e-39)
    params = [GREEDY, tiny, SamplingParams(temperature=1.0, seed=2)]
    histories = [None, ([1, 2, 3, 4], 2), None]
    picked = sampler.sample(logits.clone(), params, [0, 0, 0], histories)
    assert picked.errors == {}
    alone = sampler.sample(logits[[0, 2]].clone(), [GREEDY, params[2]], [0, 0], [None, None])
    assert [picked.token_ids[0], picked.token_ids[2]] == alone.token_ids


def test_a_row_whose_draw_raises_is_reported_alone(monkeypatch):
    filters = sampler.apply_filters

    def broken(logits, params):
        if params.seed == DOOMED.seed:
            raise RuntimeError("injected")
        return filters(logits, params)

    monkeypatch.setattr(sampler, "apply_filters", broken)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [GREEDY, DOOMED, SamplingParams(temperature=1.0, seed=3), GREEDY]
    picked = sampler.sample(logits.clone(), params, [0] * 4)
    assert set(picked.errors) == {1} and "injected" in picked.errors[1]
    alone = sampler.sample(logits[[0, 2, 3]].clone(), [params[i] for i in (0, 2, 3)], [0] * 3)
    assert [picked.token_ids[i] for i in (0, 2, 3)] == alone.token_ids


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_num_seqs=16)


def test_one_failing_row_of_16_ends_alone_on_the_default_model(engine, monkeypatch):
    alone = []
    for prompt in PROMPTS:
        request_id = engine.add_request(prompt, GREEDY)
        alone.append(_finish(engine)[request_id].token_ids)
    filters = sampler.apply_filters

    def broken(logits, params):
        if params.seed == DOOMED.seed:
            raise RuntimeError("injected")
        return filters(logits, params)

    monkeypatch.setattr(sampler, "apply_filters", broken)
    ids = [engine.add_request(p, DOOMED if i == VICTIM else GREEDY) for i, p in enumerate(PROMPTS)]
    done = _finish(engine)
    assert done[ids[VICTIM]].finish_reason is FinishReason.ERROR
    assert "injected" in done[ids[VICTIM]].error
    for i, request_id in enumerate(ids):
        if i != VICTIM:
            assert done[request_id].token_ids == alone[i], f"row {i} changed"
    engine.check_integrity()
    assert engine.kv_manager.pool.num_used_blocks == 0


def _finish(engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done
