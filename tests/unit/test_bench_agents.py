"""``kvwise bench agents``' rate over the time with a turn in flight (issue 29)."""

from __future__ import annotations

import math

import pytest

from kvwise.bench.agents import in_flight_s, tool_latencies


def test_in_flight_time_is_the_union_of_the_turns_spans():
    # overlapping, nested, touching and disjoint spans, in no order
    spans = [(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (1.5, 1.8), (3.0, 4.0), (10.0, 10.5)]
    assert in_flight_s(spans) == pytest.approx(4.0 + 2.0 + 0.5)
    assert in_flight_s([]) == 0.0


def test_a_long_tool_tail_counts_in_the_wall_time_but_not_in_flight():
    # two agents: one turn each, then one of them sleeps 100 s before its last turn
    spans = [(0.0, 2.0), (0.5, 2.5), (102.5, 103.5)]
    wall = 103.5
    assert len(spans) / wall < 0.03
    assert len(spans) / in_flight_s(spans) == pytest.approx(3 / 3.5)


def test_tool_latencies_have_the_median_and_p90_asked_for():
    lat = sorted(tool_latencies(20_000, 2.0, 15.0, seed=1))
    assert lat[len(lat) // 2] == pytest.approx(2.0, rel=0.05)
    assert lat[int(0.9 * len(lat))] == pytest.approx(15.0, rel=0.08)
    assert tool_latencies(5, 2.0, 15.0, seed=1) == tool_latencies(5, 2.0, 15.0, seed=1)
    assert all(math.isfinite(x) and x > 0 for x in lat)
