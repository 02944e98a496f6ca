"""Prometheus metrics of one server, in a registry of its own (several apps may share a process).

Per request (recorded when it ends): requests by route and status, prompt / cached / generated
tokens, TTFT, every inter-token latency, end-to-end latency; requests cancelled by a hang-up,
and their sequences aborted. From the engine (read at scrape time
from its last stats): one series per field that ``EngineStats``, ``KVCacheStats`` and
``StoreStats`` name a metric for in their metadata (``core.stat_fields``: the waiting queue,
running requests, KV blocks used / cached-free / free / kept, utilisation, prefix-cache query
and hit tokens, preemptions, load rollbacks; the store's load / recompute decisions, loaded and
recomputed-instead tokens, chunks written, writes dropped, bytes waiting to be written), one
series per tier (label ``tier``) for every ``TierStats`` field, whether the engine is up, and
each tier's break-even prefix length under the cost model's current fit. A new stats field
with a metric needs no edit here. Per tenant (the API key's tenant, ``default`` without
keys): requests, prompt, generated and cached tokens, for at most ``max_tenants`` tenants by
name (``request_stats.TenantTable``: the quietest tenant folds into "(other)" when a new one
comes to a full table), for the dashboard only: ``/metrics`` needs no key, so it carries no
tenant's name or usage (another tenant could read them). The bill per tenant (``ledger.py``:
``ledger``) is on /metrics as ``kvwise_tenant_tokens_total{tenant,kind}`` only for a scrape
that may see the dashboard (the admin key as Bearer, or an open server: ``render(tenants=
True)``). Each finished request also writes one log line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvwise.core.kv_stats import KVCacheStats
from kvwise.core.stat_fields import COUNTER, MetricField, metric_fields
from kvwise.engine.client import EngineClient
from kvwise.engine.stats import EngineStats
from kvwise.server.ledger import TenantTokensCollector, UsageLedger
from kvwise.server.request_stats import RecentValues, TenantTable
from kvwise.store.stats import StoreStats, TierStats
from kvwise.types import RequestOutput

logger = logging.getLogger("kvwise.server")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Gauges and counters read from the engine's typed stats at scrape time: one family per
    metric its stats dataclasses' fields name (``core.stat_fields``), so a new stats field
    needs no edit here; the engine's liveness and the tiers' break-even besides."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily(
            "kvwise_engine_up", "1 while the engine loop runs", value=int(self.engine.is_running)
        )
        yield from _families(s, EngineStats)
        yield from _families(s.kv, KVCacheStats)
        if s.store is not None:
            yield from _families(s.store, StoreStats)
            yield from _families(s.store.tiers, TierStats, per="tier")
        curves = self.engine.cost_curves()
        if curves is not None:
            break_even = GaugeMetricFamily(
                "kvwise_kv_tier_break_even_tokens",
                "shortest prefix (tokens) from which the cost model predicts that loading it "
                "from the tier beats recomputing it (no series: recomputing always wins)",
                labels=["tier"],
            )
            for curve in curves.tiers:
                if curve.break_even_tokens is not None:
                    break_even.add_metric([curve.tier], curve.break_even_tokens)
            yield break_even


def _families(stats, stats_type: type, per: str | None = None):
    """The families ``stats_type``'s fields name, valued from ``stats`` (with ``per``: a dict
    of such stats, one series each, labelled ``per`` with its key). Fields naming one metric
    are one family, told apart by their fixed labels (the store's decisions)."""
    by_metric: dict[str, list[MetricField]] = {}
    for f in metric_fields(stats_type):
        by_metric.setdefault(f.metric, []).append(f)
    items = stats.items() if per is not None else [(None, stats)]
    for name, fields in by_metric.items():
        first = fields[0]
        family = CounterMetricFamily if first.kind == COUNTER else GaugeMetricFamily
        labels = [per] if per is not None else []
        metric = family(name, first.help, labels=labels + [k for k, _ in first.labels])
        for key, one in items:
            for f in fields:
                values = [key] if per is not None else []
                metric.add_metric(values + [v for _, v in f.labels], getattr(one, f.attr))
        yield metric


@dataclass(frozen=True)
class RequestTotals:
    """Totals of the per-request series since start."""

    finished: dict[str, int]  # finish reason -> generation requests ended with it
    by_status: dict[str, int]  # HTTP status -> requests answered with it (every route)
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    ttft_sum_s: float
    ttft_count: int
    num_ttfts_seen: int = 0  # TTFTs observed (recent_ttfts_s: the last of them)
    recent_ttfts_s: tuple[float, ...] = ()


def _total(counter: Counter) -> int:
    return int(
        sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
    )


def _by_label(counter: Counter, label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in counter.collect():
        for s in m.samples:
            if s.name.endswith("_total"):
                key = s.labels[label]
                out[key] = out.get(key, 0) + int(s.value)
    return out


class ServerMetrics:
    """The server's registry, and the per-request figures the dashboard reads (``totals``,
    ``tenants``).

    Args:
        engine: read at scrape time for its stats.
        max_tenants: tenants with series (and dashboard rows) of their own.
        recent_ttfts: the last TTFTs kept for the dashboard's percentiles.
    """

    def __init__(
        self, engine: EngineClient, max_tenants: int = 50, recent_ttfts: int = 256
    ) -> None:
        self.registry = registry = CollectorRegistry()
        self.tenants = TenantTable(max_tenants)
        self.recent_ttfts = RecentValues(recent_ttfts)
        self.requests = Counter(
            "kvwise_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvwise_prompt_tokens", "prompt tokens of finished requests", registry=registry
        )
        self.cached_tokens = Counter(
            "kvwise_cached_prompt_tokens",
            "prompt tokens read from the prefix cache",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "kvwise_generation_tokens", "tokens generated", registry=registry
        )
        self.finished = Counter(
            "kvwise_requests_finished",
            "generation requests by finish reason",
            ["finish_reason"],
            registry=registry,
        )
        self.cancelled = Counter(
            "kvwise_requests_cancelled",
            "generation requests whose client hung up before the answer was whole",
            registry=registry,
        )
        self.sequences_cancelled = Counter(
            "kvwise_sequences_cancelled",
            "sequences (choices x prompts) of those requests not yet finished, aborted",
            registry=registry,
        )
        self.ttft = Histogram(
            "kvwise_time_to_first_token_seconds",
            "time to first token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "kvwise_inter_token_latency_seconds",
            "time between two output tokens",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "kvwise_request_latency_seconds",
            "arrival to last token",
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineCollector(engine))
        self.ledger = UsageLedger()  # the bill per tenant, fed by Generation.ended

    def observe_cancelled(self, num_sequences: int) -> None:
        """A request whose client hung up, with its ``num_sequences`` aborted (or never
        admitted)."""
        self.cancelled.inc()
        self.sequences_cancelled.inc(num_sequences)

    def render(self, tenants: bool = False) -> bytes:
        """The exposition text; ``tenants``: with the per-tenant series (admin only)."""
        text = generate_latest(self.registry)
        return text + generate_latest(TenantTokensCollector(self.ledger)) if tenants else text

    def totals(self) -> RequestTotals:
        """The per-request series so far, summed over their labels (the dashboard's source)."""
        ttft = {s.name: s.value for m in self.ttft.collect() for s in m.samples}
        num_ttfts_seen, recent_ttfts_s = self.recent_ttfts.snapshot()
        return RequestTotals(
            finished=_by_label(self.finished, "finish_reason"),
            by_status=_by_label(self.requests, "status"),
            prompt_tokens=_total(self.prompt_tokens),
            cached_tokens=_total(self.cached_tokens),
            generation_tokens=_total(self.generation_tokens),
            ttft_sum_s=ttft.get("kvwise_time_to_first_token_seconds_sum", 0.0),
            ttft_count=int(ttft.get("kvwise_time_to_first_token_seconds_count", 0)),
            num_ttfts_seen=num_ttfts_seen,
            recent_ttfts_s=recent_ttfts_s,
        )

    def observe_request(
        self, request_id: str, tenant: str, out: RequestOutput | None, finish_reason: str
    ) -> None:
        """Record one ended request (``out``: its last output, None if none came) and log it."""
        self.finished.labels(finish_reason).inc()
        if out is None:
            self.tenants.record(tenant, 0, 0, 0)
            logger.info("%s tenant=%s no output, finish=%s", request_id, tenant, finish_reason)
            return
        m = out.metrics
        num_generated = len(out.token_ids)
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_tokens.inc(out.num_cached_tokens)
        self.generation_tokens.inc(num_generated)
        self.tenants.record(tenant, out.num_prompt_tokens, num_generated, out.num_cached_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
            self.recent_ttfts.add(m.ttft)
        for gap in m.inter_token_times:
            self.itl.observe(gap)
        end = m.finished_time or time.perf_counter()
        self.e2e.observe(end - m.arrival_time)
        decode_s = end - m.first_token_time if m.first_token_time is not None else 0.0
        rate = (num_generated - 1) / decode_s if num_generated > 1 and decode_s > 0 else 0.0
        ttft = f"{m.ttft * 1000:.0f}ms" if m.ttft is not None else "-"
        logger.info(
            "%s tenant=%s prompt=%d cached=%d completion=%d ttft=%s tokens/s=%.1f finish=%s",
            request_id,
            tenant,
            out.num_prompt_tokens,
            out.num_cached_tokens,
            num_generated,
            ttft,
            rate,
            finish_reason,
        )
