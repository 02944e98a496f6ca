"""Cache breakpoints (Anthropic's cache_control) in the core: keep runs (the longest TTL
covering each block, the minimum length, the TTL scale), keeps in the pool that outlive LRU
pressure and are refreshed by hits, expiry that makes the next request create the prefix
again (device and tiers), TTLs of the saves, and the reported counts. Exact counts
throughout; the pool clock is a fake."""

import pytest

from kvwise.config import SchedulerConfig
from kvwise.core.breakpoints import BreakpointPolicy, KeepRun, created_tokens, save_ttl
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_tiers import ChunkWrite, LoadPlan, PlannedChunk
from kvwise.core.request import Request
from kvwise.core.scheduler import Scheduler
from kvwise.types import CacheBreakpoint, RequestOptions, SamplingParams
from kvwise.worker.fake_runner import FakeModelRunner

BS = 4
P = SamplingParams(max_tokens=1, temperature=0)
MIN = 8  # the policy's minimum cacheable length in these tests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks=16, clock=None, min_tokens=MIN, scale=1.0, **kw):
    return KVCacheManager(
        num_blocks,
        BS,
        model_fingerprint="m",
        clock=clock or Clock(),
        breakpoints=BreakpointPolicy(min_tokens, scale),
        **kw,
    )


def request(rid, tokens, breakpoints=(), tenant="alice"):
    options = RequestOptions(tenant=tenant, cache_breakpoints=breakpoints)
    return Request(rid, list(tokens), P, options=options)


def run(m, rid, tokens, breakpoints=(), tenant="alice"):
    """A request's prompt computed through the manager, then freed. Returns (request, tokens
    found cached)."""
    req = request(rid, tokens, breakpoints, tenant)
    blocks, num_cached = m.get_computed_blocks(req)
    req.num_cached_tokens = num_cached
    assert m.allocate_slots(req, len(req.token_ids) - num_cached, blocks) is not None
    req.num_computed_tokens = len(req.token_ids)
    m.cache_full_blocks(req)
    m.free(req)
    return req, num_cached


# ---- keep runs ------------------------------------------------------------------------------


def test_runs_give_each_block_the_longest_ttl_covering_it():
    policy = BreakpointPolicy(min_tokens=MIN, ttl_scale=0.5)
    req = request("a", range(40), [(14, 3600), (30, 300), (6, 300)])  # 6 < MIN: nothing
    assert policy.runs(req, BS) == (
        KeepRun(0, 3, 1800.0, 3600.0, BS),  # 14 tokens: 3 full blocks, 1h (scaled by 0.5)
        KeepRun(3, 7, 150.0, 300.0, BS),  # 30 tokens: blocks 3..6 under the 5m one only
    )
    # a breakpoint past the prompt covers the prompt's full blocks
    assert policy.runs(request("b", range(10), [(64, 300)]), BS) == (
        KeepRun(0, 2, 150.0, 300.0, BS),
    )
    # a 1h breakpoint after a 5m one (Anthropic's route refuses it; the engine takes it):
    # the longest TTL covers every block
    assert policy.runs(request("d", range(40), [(8, 300), (16, 3600)]), BS) == (
        KeepRun(0, 4, 1800.0, 3600.0, BS),
    )
    # two of the same TTL make one run
    assert policy.runs(request("c", range(40), [(12, 300), (24, 300)]), BS) == (
        KeepRun(0, 6, 150.0, 300.0, BS),
    )


def test_breakpoints_are_validated_naming_the_field():
    for bad in ([(1, 300)] * 5, [(0, 300)], [(8, 0)], [(8, 1e9)], [(8.5, 300)], [(8,)], "x"):
        with pytest.raises(ValueError, match="cache_breakpoints"):
            RequestOptions(cache_breakpoints=bad)
    ok = RequestOptions(cache_breakpoints=[(16, 300), CacheBreakpoint(8, 3600)])
    assert ok.cache_breakpoints == (CacheBreakpoint(8, 3600.0), CacheBreakpoint(16, 300.0))
    with pytest.raises(ValueError, match="cache_min_tokens"):
        BreakpointPolicy(min_tokens=-1)
    with pytest.raises(ValueError, match="cache_ttl_scale"):
        BreakpointPolicy(ttl_scale=0.0)


# ---- the pool -------------------------------------------------------------------------------


def test_blocks_under_a_1h_breakpoint_outlive_lru_pressure():
    clock = Clock()
    m = manager(16, clock)
    system = list(range(100, 116))  # 4 blocks
    first, cached = run(m, "a", system + [1, 2], [(16, 3600)])
    assert cached == 0 and created_tokens(first) == {3600.0: 16}
    assert m.pool.num_retained == {"alice": 4}
    # other traffic (another tenant's, plain LRU) takes every other block, twice over
    for i in range(6):
        run(m, f"x{i}", range(1000 * (i + 1), 1000 * (i + 1) + 40), tenant="bob")
    clock.now += 3000  # within the hour
    again, cached = run(m, "b", system + [7, 8, 9])
    assert cached == 16  # read, not computed
    assert created_tokens(again) == {}  # (no breakpoint of its own: nothing created)
    m.check_integrity()


def test_without_a_breakpoint_the_same_prefix_is_evicted():
    m = manager(16)
    system = list(range(100, 116))
    run(m, "a", system + [1, 2])
    for i in range(6):
        run(m, f"x{i}", range(1000 * (i + 1), 1000 * (i + 1) + 40), tenant="bob")
    assert run(m, "b", system + [7, 8, 9])[1] == 0


def test_an_expired_5m_breakpoint_is_created_again_and_a_hit_refreshes_it():
    clock = Clock()
    m = manager(32, clock)
    system = list(range(100, 116))
    run(m, "a", system + [1], [(16, 300)])
    clock.now += 240  # a hit within 5 minutes reads it and keeps it 5 minutes more
    req, cached = run(m, "b", system + [2], [(16, 300)])
    assert cached == 16 and created_tokens(req) == {}
    clock.now += 240  # 480 s after the first, 240 after the hit: still kept
    req, cached = run(m, "c", system + [3], [(16, 300)])
    assert cached == 16
    clock.now += 301  # nobody for more than 5 minutes: the blocks are still in the pool...
    assert all(m.pool.get_cached_block(h) is not None for h in req.block_hashes[:4])
    req, cached = run(m, "d", system + [4], [(16, 300)])
    assert cached == 0  # ...but the prefix is created again, as Anthropic's
    assert created_tokens(req) == {300.0: 16}
    assert m.stats().breakpoint_expiries == 1
    req, cached = run(m, "e", system + [5], [(16, 300)])
    assert cached == 16  # and read from then on
    m.check_integrity()


def test_a_hit_refreshes_the_keep_while_its_request_runs():
    clock = Clock()
    m = manager(32, clock)
    system = list(range(100, 116))
    run(m, "a", system + [1], [(16, 300)])  # kept until 400
    clock.now += 250
    long = request("long", system + [2], [(16, 300)])  # reads it at 350, runs for minutes
    blocks, cached = m.get_computed_blocks(long)
    assert cached == 16 and m.allocate_slots(long, 1, blocks) is not None
    clock.now += 200  # 550: past the first keep, within the one its hit began
    assert run(m, "c", system + [3], [(16, 300)])[1] == 16
    m.free(long)
    m.check_integrity()


def test_after_expiry_a_plain_request_recomputes_once_then_lru_serves_it():
    clock = Clock()
    m = manager(32, clock)
    system = list(range(100, 116))
    run(m, "a", system + [1], [(16, 300)])
    clock.now += 400
    assert run(m, "b", system + [2])[1] == 0  # expired: recomputed
    assert run(m, "c", system + [3])[1] == 16  # plain prefix caching from then on


def test_the_1h_run_of_a_prompt_outlives_its_5m_run():
    clock = Clock()
    m = manager(32, clock)
    prompt = list(range(100, 125))  # 6 full blocks
    run(m, "a", prompt, [(8, 3600), (24, 300)])
    clock.now += 600
    req, cached = run(m, "b", prompt, [(8, 3600), (24, 300)])
    assert cached == 8  # the 1h blocks read; the 5m ones created again
    assert created_tokens(req) == {300.0: 16}


def test_a_breakpoint_below_the_minimum_keeps_nothing():
    m = manager(16, min_tokens=16)
    req, _ = run(m, "a", range(100, 120), [(12, 3600)])
    assert req.keep_runs == () and created_tokens(req) == {}
    assert m.pool.num_retained == {}


def test_keeps_stay_within_the_tenant_cap():
    m = manager(16, max_retained_blocks_per_tenant=3)
    run(m, "a", range(100, 121), [(20, 3600)])  # 5 blocks under the breakpoint
    assert m.pool.num_retained == {"alice": 3}
    m.check_integrity()


def test_tenants_never_share_a_breakpoint():
    m = manager(32)
    system = list(range(100, 116))
    run(m, "a", system + [1], [(16, 3600)], tenant="alice")
    req, cached = run(m, "b", system + [1], [(16, 3600)], tenant="bob")
    assert cached == 0 and created_tokens(req) == {3600.0: 16}


# ---- the tiers --------------------------------------------------------------------------


class Planner:
    """Once ``holds``, holds every block of every prompt; records the load plans and the
    keeps."""

    def __init__(self) -> None:
        self.plans: list[tuple[int, int]] = []  # (device blocks, max blocks)
        self.holds = False
        self.keeps: list[tuple[int, int, float, str]] = []  # (first, blocks, ttl_s, owner)

    def plan_load(self, request_id, block_hashes, num_device_blocks, max_blocks, num_tokens):
        self.plans.append((num_device_blocks, max_blocks))
        if not self.holds or max_blocks <= num_device_blocks:
            return None
        hashes = tuple(block_hashes[num_device_blocks:max_blocks])
        chunk = PlannedChunk(num_device_blocks, len(hashes), hashes, ("fake",))
        return LoadPlan(len(hashes), [chunk])

    def plan_span(self, block_hashes, start, end):
        return None

    def roll_back(self, plan, num_loaded_blocks):
        pass

    def plan_writes(self, block_hashes, num_full_blocks, cuts=(), first_block=0):
        ends = sorted({c for c in cuts if 0 < c < num_full_blocks} | {num_full_blocks})
        writes, first = [], 0
        for end in ends:
            writes.append(ChunkWrite(first, tuple(block_hashes[first:end])))
            first = end
        return writes

    def plan_keeps(self, block_hashes, num_full_blocks, cuts=(), first_block=0):
        return self.plan_writes(block_hashes, num_full_blocks, cuts) if self.holds else []

    def keep(self, chunks, ttl_s, owner):
        self.keeps += [(c.first_block, len(c.block_hashes), ttl_s, owner) for c in chunks]


def serve(scheduler, runner, req):
    scheduler.add_request(req)
    while req.request_id in scheduler.requests:
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))
    return req


def test_saves_carry_each_run_s_ttl_and_an_expired_prefix_is_not_loaded():
    clock = Clock()
    planner = Planner()
    m = manager(32, clock, scale=0.01)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), m, 1000, tiers=planner)
    runner = FakeModelRunner(32, BS)
    prompt = list(range(100, 130))  # 7 full blocks
    bps = [(8, 3600), (20, 300)]
    serve(scheduler, runner, request("a", prompt, bps))
    saves = [
        (s.chunk.first_block, len(s.chunk.block_hashes), s.ttl_s, s.tenant)
        for s in scheduler.take_saves()
    ]
    # entries cut where the runs end: 1h (scaled: 36 s) over blocks 0-1, 5m (3 s) over 2-4
    assert saves == [(0, 2, 36.0, "alice"), (2, 3, 3.0, "alice"), (5, 2, None, "alice")]
    m.pool.reset_prefix_cache()  # the pool forgets them: the tiers hold them
    planner.holds = True
    clock.now += 10  # past the 5m run's 3 s, within the 1h run's 36 s
    req = serve(scheduler, runner, request("b", prompt, bps))
    # the load stops where the expired run starts: blocks 0-1 loaded, 2.. computed again
    assert planner.plans[-1] == (0, 2)
    assert req.num_cached_tokens == 8 and created_tokens(req) == {300.0: 12}
    # leaving, it keeps the entries the tiers hold for its runs' TTLs again (a hit refreshes
    # them in the tiers as in the pool); blocks past the runs are not kept
    assert planner.keeps == [(0, 2, 36.0, "alice"), (2, 3, 3.0, "alice")]


# ---- the reports ------------------------------------------------------------------------


def test_created_tokens_count_what_the_request_computed_under_its_runs():
    req = request("a", range(40), [(16, 3600), (36, 300)])
    req.keep_runs = BreakpointPolicy(MIN).runs(req, BS)
    req.num_cached_tokens = 8  # read the first two blocks
    assert created_tokens(req) == {3600.0: 8, 300.0: 20}
    req.num_cached_tokens = 24  # past the 1h run
    assert created_tokens(req) == {300.0: 12}


def test_save_ttl_is_the_longest_of_retention_and_the_run():
    # prompt_cache_retention "24h" (the Chat Completions / Responses field) is retention
    # "24h": every entry of the request is written with a day's TTL, a breakpoint's shorter
    # one does not shorten it
    req = Request(
        "a",
        list(range(40)),
        P,
        options=RequestOptions(retention="24h", cache_breakpoints=[(16, 300)]),
    )
    req.keep_runs = BreakpointPolicy(MIN).runs(req, BS)
    assert [save_ttl(req, end) for end in (2, 4, 9)] == [86400.0] * 3
    req = request("b", range(40), [(16, 3600)])
    req.keep_runs = BreakpointPolicy(MIN).runs(req, BS)
    assert [save_ttl(req, end) for end in (2, 4, 5)] == [3600.0, 3600.0, None]


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--cache-ttl-scale", "0", "must be a finite number > 0"),
        ("--cache-min-tokens", "-5", ">= 0"),
    ],
)
def test_bad_flags_stop_the_server_naming_them(capsys, flag, value, says):
    from kvwise.cli import main

    assert main(["serve", flag, value, "--port", "18461"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvwise: error: {flag}: ") and says in err[0]
