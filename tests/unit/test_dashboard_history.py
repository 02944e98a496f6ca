"""The dashboard's bookkeeping without a server: samples spaced by the clock, a bounded
history, hit rates per tier over a sliding window, 429s per interval, and the request totals
read back from the Prometheus series."""

from __future__ import annotations

import dataclasses

import pytest

from kvwise.core.kv_stats import KVCacheStats
from kvwise.core.stat_fields import metric_fields
from kvwise.engine.async_engine import AsyncEngine
from kvwise.engine.stats import EngineStats
from kvwise.server.dashboard import Dashboard
from kvwise.server.dashboard_series import DashboardHistory, Sample, stat_key, stat_values
from kvwise.server.metrics import ServerMetrics
from kvwise.server.request_stats import (
    OTHER_TENANTS,
    RecentValues,
    TenantCounts,
    TenantTable,
    percentile,
    since,
)
from kvwise.store.stats import StoreStats, TierStats
from kvwise.types import SamplingParams
from tests.fakes import fake_engine
from tests.store_util import FakeClock

STATS = {
    **stat_values(None, EngineStats), **stat_values(None, KVCacheStats),
    **stat_values(None, StoreStats), "blocks_total": 100,
}  # fmt: skip
ZERO = Sample(
    t=0.0, engine_up=True, stats=STATS, tier_loaded_tokens={"host": 0, "disk": 0},
    requests_finished=0, rejected_429=0, ttft_sum_s=0.0, ttft_count=0,
)  # fmt: skip


def history(samples: list[Sample], window: int = 2, max_samples: int = 100) -> DashboardHistory:
    feed = iter(samples)
    clock = FakeClock(0.0)
    h = DashboardHistory(lambda: next(feed), interval_s=1.0, window=window,
                         max_samples=max_samples, clock=clock)  # fmt: skip
    for _ in samples:
        h.sample()
        clock.t += 1.0
    return h


def test_samples_are_spaced_by_half_an_interval():
    calls = []
    clock = FakeClock(0.0)
    h = DashboardHistory(lambda: calls.append(1) or ZERO, interval_s=2.0, clock=clock)
    h.sample()
    h.sample()
    clock.t += 0.9
    h.sample()
    assert len(calls) == 1
    clock.t += 0.2
    h.sample()
    assert len(calls) == len(h.samples) == 2


def test_history_keeps_the_last_samples():
    h = history([dataclasses.replace(ZERO, t=float(i)) for i in range(10)], max_samples=4)
    assert [s.t for s in h.samples] == [6.0, 7.0, 8.0, 9.0]
    assert h.series()["t"] == [-3.0, -2.0, -1.0, 0.0]


def test_hit_rates_per_tier_over_the_window():
    def s(t, query, device, host, disk=0):
        stats = {**STATS, "prefix_query_tokens": query, "prefix_hit_tokens": device}
        return dataclasses.replace(ZERO, t=t, stats=stats,
                                   tier_loaded_tokens={"host": host, "disk": disk})  # fmt: skip

    h = history([s(0, 0, 0, 0), s(1, 100, 50, 0), s(2, 200, 50, 100), s(3, 200, 50, 100),
                 s(4, 200, 50, 100)])  # fmt: skip
    rates = h.series()["hit_rate"]
    assert list(rates) == ["device pool", "host", "disk"]
    assert rates["device pool"] == [None, 0.5, 0.25, 0.0, None]  # window: 2 samples back
    assert rates["host"] == [None, 0.0, 0.5, 1.0, None]
    assert rates["disk"] == [None, 0.0, 0.0, 0.0, None]


def test_429s_per_interval_and_windowed_ttft():
    samples = [
        dataclasses.replace(ZERO, t=float(i), rejected_429=r, ttft_sum_s=ts, ttft_count=tc)
        for i, (r, ts, tc) in enumerate([(0, 0.0, 0), (3, 1.0, 2), (3, 1.0, 2), (7, 4.0, 3)])
    ]
    series = history(samples).series()
    assert series["rejected_429"] == [0, 3, 0, 4]
    assert series["ttft_mean_s"] == [None, 0.5, 0.5, pytest.approx(3.0)]


def test_empty_history_and_bad_settings():
    assert DashboardHistory(lambda: ZERO).series() == {"t": []}
    for bad in ({"interval_s": 0}, {"max_samples": 1}, {"window": 0}):
        with pytest.raises(ValueError, match="^dashboard: "):
            DashboardHistory(lambda: ZERO, **bad)


def test_request_totals_sum_the_series_over_their_labels():
    class NoEngine:  # totals read only the per-request series
        pass

    m = ServerMetrics(NoEngine())
    m.requests.labels("/v1/completions", "200").inc(2)
    m.requests.labels("/v1/chat/completions", "429").inc(3)
    m.requests.labels("/v1/completions", "429").inc()
    m.finished.labels("stop").inc()
    m.finished.labels("length").inc(2)
    m.ttft.observe(0.25)
    m.ttft.observe(0.5)
    m.prompt_tokens.inc(40)
    totals = m.totals()
    assert totals.by_status == {"200": 2, "429": 4}
    assert totals.finished == {"stop": 1, "length": 2}
    assert (totals.ttft_count, totals.ttft_sum_s, totals.prompt_tokens) == (2, 0.75, 40)
    assert totals.generation_tokens == totals.cached_tokens == 0


def test_every_stats_field_reaches_the_json_by_its_key():
    """The data carries every field the stats name a metric for (a new field needs no edit in
    the dashboard), each under one key, and the keys the page reads keep their values."""
    stats_types = (EngineStats, KVCacheStats, StoreStats)
    keys = [stat_key(f.attr) for cls in stats_types for f in metric_fields(cls)]
    assert len(keys) == len(set(keys))  # no two fields share a key
    engine = AsyncEngine(fake_engine(kv_host_memory="1MiB"))
    try:
        data = Dashboard(engine, ServerMetrics(engine), "fake").data()
    finally:
        engine.shutdown()
    stats = engine.stats()
    now = data["now"]
    assert set(keys) <= set(now)
    assert now["waiting"] == stats.num_waiting and now["preemptions"] == stats.num_preemptions
    assert now["tool_pauses"] == stats.tool_pauses and "tool_recomputed_tokens" in now
    assert now["blocks_total"] == stats.kv.blocks_total == 64
    assert now["blocks_cached"] == now["blocks_cached_free"] == stats.kv.blocks_cached_free
    assert now["lookup_misses"] == stats.store.lookup_misses
    (tier,) = data["tiers"]
    tier_keys = {stat_key(f.attr) for f in metric_fields(TierStats)}
    assert set(tier) == {"name", "degraded"} | tier_keys and tier["degraded"] == ""
    assert {"entries", "bytes", "hits", "misses", "faults", "loads", "load_seconds"} <= tier_keys
    assert tier["entries"] == stats.store.tiers["host"].num_entries


# ---- tokens/s, TTFT percentiles, tenants ----------------------------------------------------


def test_generated_tokens_per_second_per_interval_and_over_the_window():
    def s(t, generated):
        stats = {**STATS, "generated_tokens": generated}
        return dataclasses.replace(ZERO, t=t, stats=stats)

    # a data request took the third sample half an interval after the second
    series = history([s(0, 0), s(2, 40), s(3, 70), s(5, 70), s(7, 70)]).series()
    assert series["tokens_per_s"] == [None, 20.0, 30.0, 0.0, 0.0]
    assert series["tokens_per_s_window"] == [None, 20.0, 70 / 3, 10.0, 0.0]  # window: 2


def test_ttft_percentiles_over_the_window_from_the_ttfts_of_each_interval():
    """Each sample reads the last TTFTs observed; the history keeps only those since the
    sample before, and the p50 / p99 of the window that ends with it."""
    recent: list[float] = []

    def s(t, *new):
        recent.extend(new)
        return dataclasses.replace(
            ZERO, t=t, num_ttfts_seen=len(recent), ttfts_s=tuple(recent[-4:])
        )  # the metrics keep the last 4

    h = history([s(0), s(1, 0.1, 0.2, 0.3), s(2, 0.9), s(3), s(4), s(5, *[0.5] * 6)])
    assert [x.ttfts_s for x in h.samples] == [(), (0.1, 0.2, 0.3), (0.9,), (), (), (0.5,) * 4]
    series = h.series()
    assert series["ttft_p50_s"] == [None, 0.2, 0.2, 0.9, None, 0.5]  # nearest rank
    assert series["ttft_p99_s"] == [None, 0.3, 0.9, 0.9, None, 0.5]


def test_percentiles_since_and_recent_values():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    values = [float(v) for v in range(100, 0, -1)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (
        50.0,
        99.0,
        100.0,
    )
    recent = RecentValues(maxlen=3)
    for v in (1.0, 2.0, 3.0, 4.0):
        recent.add(v)
    seen, values = recent.snapshot()
    assert (seen, values) == (4, (2.0, 3.0, 4.0))
    assert since(values, seen, 2) == (3.0, 4.0) and since(values, seen, 4) == ()
    assert since(values, seen, 0) == (2.0, 3.0, 4.0)  # no more than kept
    with pytest.raises(ValueError, match="^maxlen"):
        RecentValues(0)


def test_the_tenant_table_is_bounded_and_its_rows_add_up():
    table = TenantTable(max_tenants=2)
    for _ in range(3):
        table.record("alice", 10, 4, 8)
    table.record("bob", 5, 2, 0)
    assert [(name, c.num_requests) for name, c in table.rows()] == [("alice", 3), ("bob", 1)]
    for i in range(1000):  # a flood of new tenants churns one row; alice keeps hers
        table.record(f"t{i}", 1, 1, 0)
    rows = dict(table.rows())
    assert list(rows) == ["alice", "t999", OTHER_TENANTS]
    assert rows["alice"] == TenantCounts(3, 30, 12, 24)
    assert rows[OTHER_TENANTS] == TenantCounts(1000, 1004, 1001, 0)  # bob and t0..t998
    assert sum(c.num_requests for c in rows.values()) == 1004
    with pytest.raises(ValueError, match="^max_tenants"):
        TenantTable(0)


def test_tenants_reach_the_metrics_and_the_dashboard_data():
    core = fake_engine()
    core.add_request("hello there", SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    out = outs[-1]
    assert out.finished and len(out.token_ids) == 3
    engine = AsyncEngine(core)
    try:
        metrics = ServerMetrics(engine, max_tenants=2)
        metrics.observe_request("r1", "alice", out, "length")
        metrics.observe_request("r2", "alice", out, "length")
        metrics.observe_request("r3", "bob", None, "abort")
        tenants = Dashboard(engine, metrics, "fake").data()["tenants"]
        text = metrics.render().decode()
    finally:
        engine.shutdown()
    assert tenants == [
        {
            "name": "alice",
            "other": False,
            "requests": 2,
            "prompt_tokens": 2 * out.num_prompt_tokens,
            "generated_tokens": 6,
            "cached_tokens": 2 * out.num_cached_tokens,
        },
        {
            "name": "bob",
            "other": False,
            "requests": 1,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "cached_tokens": 0,
        },
    ]
    assert "alice" not in text and "bob" not in text  # /metrics is open: no tenant in it
