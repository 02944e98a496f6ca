"""Prometheus metrics of one server, in a registry of its own (several apps may share a process).

Per request (recorded when it ends): requests by route and status, prompt / cached / generated
tokens, TTFT, every inter-token latency, end-to-end latency. From the engine (read at scrape time
from the async engine's last stats): waiting queue depth, running requests, KV blocks used /
cached-free / free, KV utilisation, prefix-cache query and hit tokens, preemptions; with KV
tiers, one series per tier (label ``tier``) for every ``TierStats`` counter and gauge (hits,
misses, bytes read and written, load time, evictions, faults, entries and bytes held), and
the store's load / recompute decisions,
loaded and recomputed-instead tokens, chunks written, writes dropped and bytes waiting to be
written, and each tier's break-even prefix length under the cost model's current fit.
Each finished request also writes one log line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvwise.engine.client import EngineClient
from kvwise.store.base import TierStats
from kvwise.store.tiered import StoreStats
from kvwise.types import RequestOutput

logger = logging.getLogger("kvwise.server")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Gauges and counters read from the engine's typed stats at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        kv = s.kv
        gauges = {
            "kvwise_requests_waiting": ("requests in the waiting queue", s.num_waiting),
            "kvwise_requests_running": ("requests running", s.num_running),
            "kvwise_kv_blocks_total": ("KV blocks in the pool", kv.blocks_total),
            "kvwise_kv_blocks_used": ("KV blocks held by requests", kv.blocks_used),
            "kvwise_kv_blocks_cached": (
                "free KV blocks still holding a cached prefix",
                kv.blocks_cached_free,
            ),
            "kvwise_kv_blocks_free": ("free KV blocks", kv.blocks_free),
            "kvwise_kv_utilization": (
                "share of allocated KV slots holding computed tokens",
                kv.utilization,
            ),
            "kvwise_engine_up": ("1 while the engine loop runs", int(self.engine.is_running)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "kvwise_prefix_cache_queries_tokens": (
                "prompt tokens looked up in the prefix cache",
                kv.prefix_query_tokens,
            ),
            "kvwise_prefix_cache_hits_tokens": (
                "prompt tokens found in the prefix cache",
                kv.prefix_hit_tokens,
            ),
            "kvwise_preemptions": ("requests preempted for lack of KV blocks", s.num_preemptions),
            "kvwise_kv_integrity_checks": (
                "KV pool integrity checks passed while idle (a failure stops the engine)",
                s.kv_integrity_checks,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        if s.store is not None:
            yield from _tier_families(s.store)
            yield from _store_families(s.store)
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


def _tier_families(store: StoreStats):
    """One series per tier for every ``TierStats`` field: the metric name, help and kind are
    the field's metadata, and the tiers are whatever the store has (a new tier or counter
    needs no edit here)."""
    for f in dataclasses.fields(TierStats):
        family = CounterMetricFamily if f.metadata["kind"] == "counter" else GaugeMetricFamily
        metric = family(f.metadata["metric"], f.metadata["help"], labels=["tier"])
        for tier, stats in store.tiers.items():
            metric.add_metric([tier], getattr(stats, f.name))
        yield metric


def _store_families(store: StoreStats):
    """The store's own series: load / recompute decisions, loaded tokens, writes."""
    decisions = CounterMetricFamily(
        "kvwise_kv_store_decisions",
        "stored-prefix hits by what the cost model chose: load from a tier or recompute",
        labels=["decision"],
    )
    decisions.add_metric(["load"], store.load_decisions)
    decisions.add_metric(["recompute"], store.recompute_decisions)
    yield decisions
    counters = {
        "kvwise_kv_store_loaded_tokens": ("prompt tokens loaded from the tiers", "loaded_tokens"),
        "kvwise_kv_store_recomputed_tokens": (
            "stored prefix tokens the cost model chose to recompute rather than load",
            "recomputed_tokens",
        ),
        "kvwise_kv_store_lookup_misses": (
            "prompts whose continuation past the device pool no tier held",
            "lookup_misses",
        ),
        "kvwise_kv_store_chunks_written": ("KV entries written to the tiers", "chunks_written"),
        "kvwise_kv_store_writes_dropped": (
            "KV entries not written because the write queue was full",
            "writes_dropped",
        ),
    }
    for name, (doc, attr) in counters.items():
        yield CounterMetricFamily(name, doc, value=getattr(store, attr))
    yield GaugeMetricFamily(
        "kvwise_kv_store_pending_write_bytes",
        "bytes queued for the tiers, not yet written",
        value=store.pending_write_bytes,
    )


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
    def __init__(self, engine: EngineClient) -> None:
        self.registry = registry = CollectorRegistry()
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

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> RequestTotals:
        """The per-request series so far, summed over their labels (the dashboard's source)."""
        ttft = {s.name: s.value for m in self.ttft.collect() for s in m.samples}
        return RequestTotals(
            finished=_by_label(self.finished, "finish_reason"),
            by_status=_by_label(self.requests, "status"),
            prompt_tokens=_total(self.prompt_tokens),
            cached_tokens=_total(self.cached_tokens),
            generation_tokens=_total(self.generation_tokens),
            ttft_sum_s=ttft.get("kvwise_time_to_first_token_seconds_sum", 0.0),
            ttft_count=int(ttft.get("kvwise_time_to_first_token_seconds_count", 0)),
        )

    def observe_request(
        self, request_id: str, tenant: str, out: RequestOutput | None, finish_reason: str
    ) -> None:
        """Record one ended request (``out``: its last output, None if none came) and log it."""
        self.finished.labels(finish_reason).inc()
        if out is None:
            logger.info("%s tenant=%s no output, finish=%s", request_id, tenant, finish_reason)
            return
        m = out.metrics
        num_generated = len(out.token_ids)
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_tokens.inc(out.num_cached_tokens)
        self.generation_tokens.inc(num_generated)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
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
