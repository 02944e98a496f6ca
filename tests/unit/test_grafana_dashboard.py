"""docs/grafana/kvwise-dashboard.json: valid JSON in Grafana's dashboard shape, and every
metric its queries name is one that /metrics exposes (a renamed series would leave a panel
silently empty)."""

from __future__ import annotations

import json
import pathlib
import re

from prometheus_client.parser import text_string_to_metric_families

from kvwise.engine.async_engine import AsyncEngine
from kvwise.server.metrics import ServerMetrics
from tests.fakes import fake_engine

DASHBOARD = pathlib.Path(__file__).parents[2] / "docs" / "grafana" / "kvwise-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed_names() -> set[str]:
    """The series names /metrics has for an engine with a host tier."""
    metrics = ServerMetrics(AsyncEngine(fake_engine(kv_host_memory="1MiB")))
    names = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def test_grafana_dashboard_parses_and_names_real_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "kvwise" and dashboard["uid"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 10
    exposed = exposed_names()
    used = set()
    for p in panels:
        assert p["type"] in ("timeseries", "stat") and set(p["gridPos"]) == {"x", "y", "w", "h"}
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for target in p["targets"]:
            names = set(re.findall(r"\bkvwise_[a-z0-9_]+", target["expr"]))
            assert names, target["expr"]
            used |= names
    assert not used - exposed, f"not in /metrics: {sorted(used - exposed)}"
    # the quantities the dashboard is for
    for name in (
        "kvwise_kv_blocks_used",
        "kvwise_kv_tier_loaded_tokens_total",
        "kvwise_kv_store_decisions_total",
        "kvwise_kv_tier_break_even_tokens",
        "kvwise_requests_waiting",
        "kvwise_http_requests_total",
    ):
        assert name in used, name
