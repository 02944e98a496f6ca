"""The cost model as curves (what the dashboard draws and /metrics' break-even gauge reads)
and the counters behind the dashboard's load-vs-recompute panel: tokens the cost model left
to be recomputed, and tokens loaded per tier. No torch."""

from __future__ import annotations

import pytest

from kvwise.store.costmodel import CostModel, cost_curves
from kvwise.store.host import HostStore
from kvwise.store.planner import ChunkPlanner
from kvwise.store.tiered import TieredStore
from kvwise.types import SamplingParams
from tests.fakes import fake_engine, run_all
from tests.store_util import chain, entry_format
from tests.tiers_util import evict_device

FMT = entry_format()  # 2 layer groups, 4-token blocks


def linear_model(gamma: float = 0.01, per_token_s: float = 0.001) -> CostModel:
    """Recompute: ``gamma`` a step plus ``per_token_s`` a token (no attention term); no copy
    cost."""
    cost = CostModel(prefill_chunk_size=512)
    cost.step.w = [gamma, per_token_s * 1e3, 0.0]
    cost.copy.w = [0.0, 0.0]
    return cost


def test_recompute_curve_equals_t_recompute():
    cost = CostModel(prefill_chunk_size=512)
    lengths = [0, 1, 16, 511, 512, 513, 1024, 3000]
    expected = [cost.t_recompute(0, n) for n in lengths]
    assert cost.recompute_curve(lengths) == pytest.approx(expected)
    assert cost.recompute_curve([]) == []
    assert CostModel(prefill_chunk_size=None).recompute_curve([5, 9]) == pytest.approx(
        [CostModel(prefill_chunk_size=None).t_recompute(0, n) for n in (5, 9)]
    )


def test_predict_load_reads_the_prior_without_making_a_fit():
    cost = CostModel(tier_priors={"host": (0.5, 0.0, 0.0)})
    cost.copy.w = [0.0, 0.0]
    assert cost.predict_load("host", 3, 1000, 0) == pytest.approx(0.5)
    assert cost.predict_load("host", 0, 0, 0) == 0.0  # nothing read
    assert cost.tiers == {}  # the engine thread alone makes fits
    cost.tier_fit("host").w = [0.1, 0.0, 0.0]
    assert cost.predict_load("host", 3, 1000, 0) == pytest.approx(0.1)


def test_break_even_is_where_loading_starts_to_win():
    # recompute: 0.01 + n/1000 s for n <= 512 tokens; the last token alone 0.011 s.
    # a read: 0.05 s flat. Loading n tokens wins once 0.05 + 0.011 <= 0.01 + (n + 1) / 1000,
    # i.e. from n = 50: the first whole 16-token block at or past it is 64.
    cost = linear_model()
    cost.tier_fit("fast").w = [0.05, 0.0, 0.0]
    cost.tier_fit("never").w = [100.0, 0.0, 0.0]
    curves = cost_curves(cost, ["fast", "never", "new"], 16, 8, 1024, lambda n: 0)
    fast, never, new = curves.tiers
    assert fast.break_even_tokens == 64
    assert never.break_even_tokens is None
    assert new.tier == "new" and new.num_observations == 0  # its prior, default: slow
    assert curves.prefix_tokens[0] == 16 and curves.prefix_tokens[-1] == 1008  # < 1024
    assert len(curves.prefix_tokens) == len(fast.ttft_s) == len(curves.recompute_ttft_s)
    i = curves.prefix_tokens.index(64)
    assert curves.recompute_ttft_s[i] == pytest.approx(0.01 + 0.065)
    assert fast.ttft_s[i] == pytest.approx(0.05 + 0.011)


def test_break_even_needs_loading_to_win_at_every_longer_prefix():
    class Crafted(CostModel):  # loading wins up to 48 tokens, loses to 128, wins from 144
        def predict_load(self, tier, num_entries, num_bytes, copy_bytes):
            return 0.0 if num_bytes <= 48 or num_bytes >= 144 else 100.0

    cost = Crafted(prefill_chunk_size=512)
    cost.step.w = [0.01, 1.0, 0.0]
    curves = cost_curves(cost, ["t"], 16, 64, 1024, lambda n: n * 16)  # bytes = tokens
    assert curves.tiers[0].break_even_tokens == 144


def test_curves_count_entries_and_bytes_by_chunk():
    # 8-block chunks of 2 entries each; a prefix of 20 blocks reads 3 chunks (6 entries) and
    # 2 * chunk(8) + chunk(4) bytes
    cost = linear_model()
    cost.tier_fit("t").w = [0.0, 1.0, 1.0]  # 1 s an entry, 1 s per GB
    curves = cost_curves(cost, ["t"], 4, 8, 200, lambda n: n * 10**7, 2, 0.0)
    i = curves.prefix_tokens.index(80)
    assert curves.tiers[0].ttft_s[i] == pytest.approx(6 + 0.2 + cost.t_recompute(80, 81))


def test_long_contexts_are_scanned_on_a_log_grid():
    cost = linear_model()
    curves = cost_curves(cost, ["host"], 16, 8, 131072, lambda n: n * 1000, num_points=40)
    assert len(curves.prefix_tokens) <= 41
    assert curves.prefix_tokens[0] == 16 and curves.prefix_tokens[-1] == 131056
    assert list(curves.prefix_tokens) == sorted(set(curves.prefix_tokens))
    assert all(n % 16 == 0 for n in curves.prefix_tokens)
    assert cost_curves(cost, ["host"], 16, 8, 16, lambda n: 0).prefix_tokens == ()


def test_tiered_store_curves_use_its_format():
    store = TieredStore([HostStore(1 << 20)], FMT, chunk_blocks=4, background=False)
    curves = store.cost_curves(max_tokens=64)
    assert [t.tier for t in curves.tiers] == ["host"]
    assert curves.prefix_tokens[0] == 4 and curves.prefix_tokens[-1] == 60
    assert store.cost.tiers == {}


def test_recomputed_tokens_count_what_the_cost_model_left():
    host = HostStore(1 << 20)
    h = chain(8)
    host.put([(FMT.entry_key(h[3], g), b"entry") for g in (0, 1)])
    p = ChunkPlanner([host], FMT, CostModel(), chunk_blocks=4, min_tokens=4, policy="auto")
    p.cost.tier_fit("host").w = [10.0, 0.0, 0.0]  # 10 s a read: recompute the 16 tokens
    assert p.plan_load("r1", h, 0, 8, 33) is None
    assert (p.recompute_decisions, p.recomputed_tokens) == (1, 16)
    p.policy = "always"
    assert p.plan_load("r2", h, 0, 8, 33) is not None
    assert (p.load_decisions, p.recomputed_tokens) == (1, 16)


def test_loaded_tokens_are_counted_per_tier():
    long = "The same long prefix every time, " * 3
    engine = fake_engine(
        kv_host_memory="1MiB", kv_store_min_tokens=8, kv_chunk_blocks=2, kv_load_policy="always"
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run_all(engine, [long], params)
    evict_device(engine)
    out = run_all(engine, [long], params)[0]
    store = engine.stats().store
    assert out.num_loaded_tokens > 0
    assert store.tiers["host"].loaded_tokens == store.loaded_tokens == out.num_loaded_tokens
    assert store.recomputed_tokens == 0
