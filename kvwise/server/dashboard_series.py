"""The dashboard's samples and the series drawn from them (``dashboard.py`` serves them).

A ``Sample`` is the server at one moment: every field the stats dataclasses name a metric for
(``core.stat_fields``; key: the field's name without ``num_``, ``stat_key``), each tier's
loaded tokens, the request totals, and the TTFTs of the requests that finished since the
sample before. ``DashboardHistory`` keeps the last ``max_samples`` (one every ``interval_s``)
and draws from them, oldest first:

- rates over a sliding window of ``window`` samples: hit rates per tier, mean TTFT, and the
  TTFT p50 / p99 (nearest rank over the TTFTs of the requests finished in the window, fixed
  when the window's last sample is taken);
- per interval: generated tokens/s (the engine's ``generated_tokens``, counted as sampled,
  over the interval's seconds) and 429s.

Everything kept is bounded: the samples, and each sample's TTFTs (at most the metrics'
``recent_ttfts``, the last of its interval).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvwise.core.kv_stats import KVCacheStats
from kvwise.core.stat_fields import metric_fields
from kvwise.engine.stats import EngineStats
from kvwise.server.metrics import RequestTotals
from kvwise.server.request_stats import percentile, since
from kvwise.store.stats import StoreStats


def stat_key(attr: str) -> str:
    """A stats field's key in the JSON: its name without the units prefix ``num_``
    (``num_waiting`` → ``waiting``, ``num_entries`` → ``entries``)."""
    return attr.removeprefix("num_")


def stat_values(stats, stats_type: type) -> dict[str, float]:
    """Every field of the stats dataclass ``stats_type`` that names a metric
    (``core.stat_fields``), by ``stat_key``, valued from ``stats`` (None: all 0, e.g. no
    store), so a new stats field reaches the JSON with no edit here."""
    fields = metric_fields(stats_type)
    if stats is None:
        return {stat_key(f.attr): 0 for f in fields}
    return {stat_key(f.attr): getattr(stats, f.attr) for f in fields}


@dataclass(frozen=True)
class Sample:
    """The server at one moment; counters are totals since start."""

    t: float  # time.time()
    engine_up: bool
    # the engine's, the pool's and the store's stats fields (``stat_values``): blocks_total,
    # blocks_used, blocks_cached_free, waiting, running, prefix_query_tokens,
    # generated_tokens, ...
    stats: dict[str, float]
    tier_loaded_tokens: dict[str, int]  # prompt tokens loaded from each tier (tier order)
    requests_finished: int
    rejected_429: int
    ttft_sum_s: float
    ttft_count: int
    num_ttfts_seen: int = 0  # TTFTs observed since start
    # as read: the last TTFTs observed; in the history: those since the sample before
    ttfts_s: tuple[float, ...] = ()
    ttft_p50_s: float | None = None  # over the window ending here (set by the history)
    ttft_p99_s: float | None = None


def take_sample(stats: EngineStats, totals: RequestTotals, engine_up: bool, t: float) -> Sample:
    tiers = stats.store.tiers if stats.store is not None else {}
    return Sample(
        t=t,
        engine_up=engine_up,
        stats={
            **stat_values(stats, EngineStats),
            **stat_values(stats.kv, KVCacheStats),
            **stat_values(stats.store, StoreStats),
        },
        tier_loaded_tokens={name: t.loaded_tokens for name, t in tiers.items()},
        requests_finished=sum(totals.finished.values()),
        rejected_429=totals.by_status.get("429", 0),
        ttft_sum_s=totals.ttft_sum_s,
        ttft_count=totals.ttft_count,
        num_ttfts_seen=totals.num_ttfts_seen,
        ttfts_s=totals.recent_ttfts_s,
    )


class DashboardHistory:
    """The last ``max_samples`` samples, one every ``interval_s``, and the series drawn from
    them (JSON-ready).

    Args:
        read: takes a sample now.
        window: samples a rate is taken over (hit rates, TTFT mean and percentiles).
        clock: seconds, for spacing the samples (tests pass their own).
    """

    def __init__(
        self,
        read: Callable[[], Sample],
        interval_s: float = 2.0,
        max_samples: int = 450,
        window: int = 15,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or max_samples < 2 or window < 1:
            raise ValueError("dashboard: interval_s > 0, max_samples >= 2 and window >= 1")
        self.read = read
        self.interval_s = interval_s
        self.window = window
        self.clock = clock
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self._last = float("-inf")
        self._lock = threading.Lock()  # the sampler task and data requests (on threads)

    def sample(self) -> Sample:
        """Take a sample unless the last one is less than half an interval old; the newest."""
        with self._lock:
            now = self.clock()
            if not self.samples or now - self._last >= self.interval_s / 2:
                self.samples.append(self._settle(self.read()))
                self._last = now
            return self.samples[-1]

    def _settle(self, s: Sample) -> Sample:
        """``s`` keeping only the TTFTs observed since the sample before, with the TTFT
        percentiles over the window that ends with it."""
        before = self.samples[-1].num_ttfts_seen if self.samples else 0
        own = since(s.ttfts_s, s.num_ttfts_seen, before)
        earlier = itertools.islice(reversed(self.samples), self.window - 1)
        values = [v for e in earlier for v in e.ttfts_s] + list(own)
        return replace(
            s, ttfts_s=own, ttft_p50_s=percentile(values, 0.5), ttft_p99_s=percentile(values, 0.99)
        )

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def series(self) -> dict:
        """Each quantity over time, oldest first; ``t`` in seconds relative to the newest.
        Rates are None where the window saw nothing to divide by."""
        with self._lock:
            samples = list(self.samples)
        if not samples:
            return {"t": []}
        newest = samples[-1]

        def windowed(num: Callable[[Sample], float], den: Callable[[Sample], float]):
            out = []
            for i, s in enumerate(samples):
                first = samples[max(0, i - self.window)]
                d = den(s) - den(first)
                out.append(None if d <= 0 else (num(s) - num(first)) / d)
            return out

        def queried(s: Sample) -> float:
            return s.stats["prefix_query_tokens"]

        def generated(s: Sample) -> float:
            return s.stats["generated_tokens"]

        hit_rate = {"device pool": windowed(lambda s: s.stats["prefix_hit_tokens"], queried)}
        for tier in newest.tier_loaded_tokens:
            hit_rate[tier] = windowed(
                lambda s, tier=tier: s.tier_loaded_tokens.get(tier, 0), queried
            )
        drawn = {key: [s.stats[attr] for s in samples] for key, attr in _DRAWN.items()}
        return {
            "t": [round(s.t - newest.t, 3) for s in samples],
            **drawn,
            "rejected_429": [
                s.rejected_429 - (samples[i - 1].rejected_429 if i else s.rejected_429)
                for i, s in enumerate(samples)
            ],
            "hit_rate": hit_rate,
            "ttft_mean_s": finite(windowed(lambda s: s.ttft_sum_s, lambda s: s.ttft_count)),
            "ttft_p50_s": finite([s.ttft_p50_s for s in samples]),
            "ttft_p99_s": finite([s.ttft_p99_s for s in samples]),
            "tokens_per_s": _per_interval(samples, generated),
            "tokens_per_s_window": finite(windowed(generated, lambda s: s.t)),
        }


def _per_interval(samples: list[Sample], counter: Callable[[Sample], float]):
    """``counter``'s increase per second over each interval (None for the first sample)."""
    out: list[float | None] = [None]
    for before, s in zip(samples, samples[1:]):
        dt = s.t - before.t
        out.append((counter(s) - counter(before)) / dt if dt > 0 else None)
    return out


# the stats the page charts over time: its series' name -> the stats key (``stat_values``)
_DRAWN = {
    "blocks_total": "blocks_total",
    "blocks_used": "blocks_used",
    "blocks_cached": "blocks_cached_free",
    "waiting": "waiting",
    "running": "running",
    "load_decisions": "load_decisions",
    "recompute_decisions": "recompute_decisions",
}


def finite(values) -> list[float | None]:
    """JSON has no NaN or infinity: a fit gone astray shows as a gap, never a 500."""
    return [v if v is not None and math.isfinite(v) else None for v in values]
