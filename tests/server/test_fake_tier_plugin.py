"""A tier kind from a plug-in: one module and one ``register_tier`` line, and it is built, loaded
from, priced by the cost model and in ``/metrics`` with no edit anywhere else."""

from __future__ import annotations

import threading
import time

import pytest

from kvwise.core.stat_fields import metric_fields
from kvwise.store import registry
from kvwise.store.costmodel import DEFAULT_TIER_PRIOR, CostModel
from kvwise.store.stats import TierStats
from tests.fakes import fake_engine

from .fake_http import (
    LONG,
    cached_tokens,
    completion,
    scrape,
    serve,
)

# ---- a new tier kind: one module, one registration line ------------------------------------


class ScratchTier:
    """A tier kind as a plug-in would add it: entries in a dict. It states no ``load_prior``,
    so the cost model starts it from its default prior."""

    name = "scratch"

    def __init__(self) -> None:
        self.stats = TierStats()
        self.entries: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def contains(self, keys):
        with self._lock:
            return [bytes(k) in self.entries for k in keys]

    def get(self, keys):
        start = time.perf_counter()
        with self._lock:
            out = [self.entries.get(bytes(k)) for k in keys]
            num_hits = sum(v is not None for v in out)
            self.stats.hits += num_hits
            self.stats.misses += len(out) - num_hits
            self.stats.bytes_read += sum(len(v) for v in out if v is not None)
            self.stats.loads += 1 if num_hits else 0
            self.stats.load_seconds += time.perf_counter() - start
        return out

    def put(self, items, ttl_s=None, owner=None) -> None:
        with self._lock:
            for key, value in items:
                self.entries[bytes(key)] = bytes(value)
                self.stats.bytes_written += len(self.entries[bytes(key)])
            self._update_gauges()

    def delete(self, keys) -> None:
        with self._lock:
            for key in keys:
                self.entries.pop(bytes(key), None)
            self._update_gauges()

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"scratch ({len(self.entries)} entries)"

    def _update_gauges(self) -> None:
        self.stats.num_entries = len(self.entries)
        self.stats.num_bytes = sum(len(v) for v in self.entries.values())


@pytest.fixture
def scratch_tier():
    registry.register_tier("scratch", lambda config: ScratchTier())  # whatever the config
    try:
        yield
    finally:
        registry.unregister_tier("scratch")


def test_a_registered_tier_is_in_metrics_with_no_edit(scratch_tier):
    engine = fake_engine(kv_host_memory="1MiB", kv_store_min_tokens=8, kv_load_policy="always")
    assert [t.name for t in engine.store.tiers] == ["host", "scratch"]

    def forget_all_but_scratch(e) -> None:
        # the device pool and the host tier forget the prefix: a load must come from scratch
        e.flush()
        host = e.store.tiers[0]
        host.delete(host.eviction_order())
        e.kv_manager.pool.reset_prefix_cache()

    with serve(engine) as (server, client):
        assert client.post("/v1/completions", json=completion(LONG)).status_code == 200
        server.engine.call_sync(forget_all_but_scratch)
        again = client.post("/v1/completions", json=completion(LONG))
        assert again.status_code == 200
        assert cached_tokens(again.json()) == (len(LONG) - 1) // 4 * 4
        metrics = scrape(client)
    scratch = (("tier", "scratch"),)
    for f in metric_fields(TierStats):  # each with its own labels (e.g. the errors' op)
        suffix = "_total" if f.kind == "counter" else ""
        labels = tuple(sorted((*scratch, *f.labels)))
        assert (f.metric + suffix, labels) in metrics, f.attr
    assert metrics[("kvwise_tier_errors_total", (("op", "read"), ("tier", "scratch")))] == 0
    assert metrics[("kvwise_kv_tier_hits_total", scratch)] > 0
    assert metrics[("kvwise_kv_tier_read_bytes_total", scratch)] > 0
    assert metrics[("kvwise_kv_tier_entries", scratch)] > 0
    assert metrics[("kvwise_kv_tier_hits_total", (("tier", "host"),))] == 0


def test_the_cost_model_starts_an_unknown_tier_from_the_default_prior():
    cost = CostModel(512, {"host": (2e-5, 2e-5, 0.4)})
    assert cost.tier_fit("scratch").w == list(DEFAULT_TIER_PRIOR)
    num_chunks, load_s, recompute_s = cost.choose(
        start_tokens=0,
        chunk_ends=[256, 512],
        chunk_tiers=["scratch", "scratch"],
        entry_bytes=[1 << 20, 1 << 20],
        block_bytes_per_token=4096.0,
        num_prompt_tokens=600,
    )
    # priced by the default prior (read = λ + μ·entries + s/GB·GB, then the copy into the
    # pool): reading both 1 MiB entries beats recomputing their 512 tokens, so both load
    lam, mu, per_gb = DEFAULT_TIER_PRIOR
    copy_s = cost.predict_load("scratch", 0, 0, 512 * 4096)
    assert num_chunks == 2
    assert load_s == pytest.approx(lam + mu * 2 + per_gb * (2 << 20) / 1e9 + copy_s)
    assert recompute_s == pytest.approx(cost.t_recompute(0, 512)) and recompute_s > load_s
    cost.observe_load("scratch", 2, 2 << 20, 0.01)
    assert cost.tier_fit("scratch").num_updates == 1


def test_a_registered_tier_alone_is_built(scratch_tier):
    engine = fake_engine(kv_store_min_tokens=8, kv_load_policy="always")
    assert engine.store is not None
    assert [t.name for t in engine.store.tiers] == ["scratch"]
