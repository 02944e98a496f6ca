"""The cost model alone (store/costmodel.py): its online fit, the recompute time it predicts,
and how many stored chunks it chooses to load."""

from __future__ import annotations

import pytest

from kvwise.store.costmodel import CostModel, OnlineFit


def test_online_fit_recovers_a_linear_law():
    fit = OnlineFit([0.0, 0.0, 0.0], prior_var=1e6, forget=1.0)
    for i in range(200):
        x = (1.0, (i % 17) / 3, (i % 5) ** 2 / 7)
        fit.update(x, 0.03 + 1.5 * x[1] + 0.2 * x[2])
    assert fit.w == pytest.approx([0.03, 1.5, 0.2], abs=1e-6)


def test_recompute_time_sums_prefill_chunks():
    cost = CostModel(prefill_chunk_size=512)
    cost.step.w = [0.01, 1.0, 0.0]  # 10 ms a step + 1 ms a token
    assert cost.t_recompute(0, 1024) == pytest.approx(2 * 0.01 + 1.024)
    assert cost.t_recompute(100, 100) == 0.0


def test_choose_loads_only_what_beats_recomputing():
    cost = CostModel(prefill_chunk_size=512)
    cost.step.w = [0.0, 1.0, 0.0]  # 1 ms a token
    cost.copy.w = [0.0, 0.0]
    cost.tier_fit("disk").w = [0.0, 0.0, 0.0]
    cost.tier_fit("redis").w = [0.2, 0.0, 0.0]  # 200 ms a read: dearer than 128 tokens
    ends, tiers, sizes = [128, 256, 384], ["disk", "disk", "redis"], [1000, 1000, 1000]
    m, t_load, t_rec = cost.choose(0, ends, tiers, sizes, 10.0, 400)
    assert m == 2 and t_load == 0.0 and t_rec == pytest.approx(0.256)
    cost.tier_fit("redis").w = [0.0, 0.0, 0.0]
    assert cost.choose(0, ends, tiers, sizes, 10.0, 400)[0] == 3
