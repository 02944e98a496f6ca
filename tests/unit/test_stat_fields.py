"""The stats dataclasses name their metrics in their fields' metadata (core/stat_fields.py)."""

import dataclasses

import pytest

from kvwise.core.kv_stats import KVCacheStats
from kvwise.core.stat_fields import COUNTER, GAUGE, metric, metric_fields
from kvwise.engine.stats import EngineStats
from kvwise.store.stats import StoreStats, TierStats

STATS = (TierStats, StoreStats, KVCacheStats, EngineStats)


@pytest.mark.parametrize("stats_type", STATS)
def test_each_exposed_field_names_one_series(stats_type):
    fields = metric_fields(stats_type)
    assert fields, "no field names a metric"
    series = [(f.metric, f.labels) for f in fields]
    assert len(series) == len(set(series)), "two fields expose the same series"
    for f in fields:
        assert f.metric.startswith("kvwise_")
        assert f.kind == GAUGE or not f.metric.endswith("_total")  # exposition appends it
        assert f.kind in (COUNTER, GAUGE) and f.help
        assert f.attr in {x.name for x in dataclasses.fields(stats_type)}


def test_nested_stats_and_bookkeeping_are_not_listed():
    assert "tiers" not in {f.attr for f in metric_fields(StoreStats)}
    assert {"kv", "store"}.isdisjoint(f.attr for f in metric_fields(EngineStats))
    assert [f.attr for f in metric_fields(TierStats)] == [
        f.name for f in dataclasses.fields(TierStats) if f.name not in ("degraded", "health")
    ]


def test_the_store_decisions_are_one_family_told_apart_by_a_label():
    by_attr = {f.attr: f for f in metric_fields(StoreStats)}
    load, recompute = by_attr["load_decisions"], by_attr["recompute_decisions"]
    assert load.metric == recompute.metric == "kvwise_kv_store_decisions"
    assert (load.labels, recompute.labels) == (
        (("decision", "load"),),
        (("decision", "recompute"),),
    )


def test_the_fields_stay_positional_and_keep_their_defaults():
    kv = KVCacheStats(100, 10, 5, 85, 0, 50, 20, 0.5)
    assert kv.blocks_free == 85 and kv.prefix_hit_rate == 0.4
    assert TierStats().hits == 0 and TierStats().load_seconds == 0.0
    assert StoreStats(1, 2, 3, 4, 5, 6, 7, {}).recomputed_tokens == 0
    assert EngineStats(1, 2, 3, 4, kv).kv_integrity_checks == 0


def test_a_field_kind_is_checked():
    with pytest.raises(ValueError, match="kind"):
        metric("kvwise_x", "x", "histogram")
