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
from kvwise.server.dashboard import Dashboard, DashboardHistory, Sample, stat_key, stat_values
from kvwise.server.metrics import ServerMetrics
from kvwise.store.stats import StoreStats, TierStats
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
    assert set(tier) == {"name"} | tier_keys
    assert {"entries", "bytes", "hits", "misses", "faults", "loads", "load_seconds"} <= tier_keys
    assert tier["entries"] == stats.store.tiers["host"].num_entries
