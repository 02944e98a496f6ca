"""The scheduler's tier path against a fake KVTierPlanner: loads planned at admission (exact
block ids), a waiting request keeping its plan, rollback of a short load, saves of finished
and preempted requests."""

from kvwise.config import SchedulerConfig
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_tiers import ChunkWrite, LoadPlan, PlannedChunk
from kvwise.core.request import Request
from kvwise.core.scheduler import Scheduler
from kvwise.types import RequestOptions, SamplingParams
from kvwise.worker.fake_runner import FakeModelRunner

BS = 4  # tokens per block
CHUNK = 2  # blocks per stored chunk
P = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class FakePlanner:
    """Holds the first ``num_stored`` blocks of every prompt; records every call."""

    def __init__(self, num_stored: int) -> None:
        self.num_stored = num_stored
        self.plans: list[tuple[str, int, int]] = []  # (request id, device blocks, max blocks)
        self.rollbacks: list[tuple[int, int]] = []  # (planned blocks, loaded blocks)
        self.writes: list[list[ChunkWrite]] = []

    def plan_load(self, request_id, block_hashes, num_device_blocks, max_blocks, num_tokens):
        self.plans.append((request_id, num_device_blocks, max_blocks))
        end = min(self.num_stored, max_blocks)
        if end <= num_device_blocks:
            return None
        chunks = []
        for first in range(num_device_blocks // CHUNK * CHUNK, end, CHUNK):
            start, stop = max(first, num_device_blocks), min(first + CHUNK, end)
            hashes = tuple(block_hashes[start:stop])
            chunks.append(PlannedChunk(start, stop - start, hashes, ("fake",)))
        return LoadPlan(end - num_device_blocks, chunks)

    def roll_back(self, plan, num_loaded_blocks):
        self.rollbacks.append((plan.num_blocks, num_loaded_blocks))

    def plan_writes(self, block_hashes, num_full_blocks, cuts=(), first_block=0):
        writes = [
            ChunkWrite(first, tuple(block_hashes[first : min(first + CHUNK, num_full_blocks)]))
            for first in range(0, num_full_blocks, CHUNK)
        ]
        self.writes.append(writes)
        return writes

    def plan_keeps(self, block_hashes, num_full_blocks, cuts=(), first_block=0):
        return []  # it never says it holds an entry: every save is a write

    def keep(self, chunks, ttl_s, owner):
        raise AssertionError("nothing is held: nothing to keep")


def make(planner, num_blocks=32, **sched):
    manager = KVCacheManager(num_blocks, BS, model_fingerprint="m")
    config = SchedulerConfig(**{"max_num_batched_tokens": 64, **sched})
    return Scheduler(config, manager, max_model_len=1000, tiers=planner), manager


def req(rid, n, start=0, params=P, **options):
    return Request(rid, list(range(start, start + n)), params, options=RequestOptions(**options))


def test_admission_loads_what_the_tiers_hold_into_exact_blocks():
    planner = FakePlanner(num_stored=4)
    scheduler, _ = make(planner)
    scheduler.add_request(req("a", 21))  # 5 full blocks; a hit may cover (21 - 1) // 4 = 5
    out = scheduler.schedule()
    assert planner.plans == [("a", 0, 5)]
    assert [(ld.request_id, ld.block_ids, ld.chunk.first_block) for ld in out.kv_loads] == [
        ("a", [0, 1], 0),
        ("a", [2, 3], 2),
    ]
    (item,) = out.scheduled
    assert (item.start_pos, item.token_ids, item.block_ids) == (
        16,
        list(range(16, 21)),
        [0, 1, 2, 3, 4, 5],
    )
    request = scheduler.requests["a"]
    assert request.num_loaded_tokens == request.num_cached_tokens == 16


def test_short_load_rolls_back_to_what_arrived_and_recomputes_the_rest():
    planner = FakePlanner(num_stored=4)
    scheduler, manager = make(planner)
    runner = FakeModelRunner(32, BS)
    scheduler.add_request(req("a", 21))
    out = scheduler.schedule()
    updates = scheduler.update(out, runner.execute(out), short_loads={"a": 1})
    assert updates == []  # nothing sampled: the step rested on KV that is not there
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == BS  # the one block that arrived
    assert request.num_loaded_tokens == request.num_cached_tokens == BS
    assert planner.rollbacks == [(4, 1)] and scheduler.num_load_rollbacks == 1
    out = scheduler.schedule()
    assert not out.kv_loads  # running requests never load again
    (item,) = out.scheduled
    assert (item.start_pos, item.token_ids) == (BS, list(range(BS, 21)))
    manager.check_integrity()


def test_a_waiting_request_keeps_its_plan():
    planner = FakePlanner(num_stored=4)
    scheduler, _ = make(planner, num_blocks=8)
    runner = FakeModelRunner(8, BS)
    scheduler.add_request(req("big", 24, start=500))  # holds 7 of 8 blocks
    out = scheduler.schedule()
    scheduler.update(out, runner.execute(out))
    scheduler.add_request(req("b", 21))  # needs 6 blocks: waits
    for _ in range(2):
        out = scheduler.schedule()
        assert [s.request_id for s in out.scheduled] == ["big"]
        scheduler.update(out, runner.execute(out))
    assert [p[0] for p in planner.plans] == ["big", "b"]  # b was planned once, not per step
    while "big" in scheduler.requests:
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))
    out = scheduler.schedule()
    assert [ld.request_id for ld in out.kv_loads] == ["b", "b"]
    assert [p[0] for p in planner.plans] == ["big", "b"]


def test_finished_and_preempted_requests_queue_their_full_blocks():
    planner = FakePlanner(num_stored=0)
    scheduler, _ = make(planner, num_blocks=8)
    runner = FakeModelRunner(8, BS)

    def saves():
        return [(s.block_ids, s.chunk.first_block, len(s.chunk.block_hashes), s.ttl_s)
                for s in scheduler.take_saves()]  # fmt: skip

    scheduler.add_request(req("a", 9, params=LONG, retention="1h"))
    out = scheduler.schedule()
    scheduler.update(out, runner.execute(out))
    # b's prompt and a block of each answer fit (blocks 3-6); the answers outgrow the pool
    scheduler.add_request(req("b", 12, start=100, params=LONG))
    out = scheduler.schedule()
    while not out.preempted_ids:
        assert saves() == []
        scheduler.update(out, runner.execute(out))
        out = scheduler.schedule()
    assert out.preempted_ids == ["b"]  # the newest, at position 16 with no block left
    # b leaves the pool: its 4 full blocks, in chunks of 2, before the blocks are reused
    assert saves() == [([3, 4], 0, 2, None), ([5, 6], 2, 2, None)]
    while "a" in scheduler.requests:
        scheduler.update(out, runner.execute(out))
        out = scheduler.schedule()
    # a finished (9 + 12 tokens, the last never computed): 5 full blocks, kept an hour
    assert saves() == [([0, 1], 0, 2, 3600.0), ([2, 7], 2, 2, 3600.0), ([6], 4, 1, 3600.0)]
    while scheduler.num_unfinished:
        scheduler.update(out, runner.execute(out))
        out = scheduler.schedule()
    assert [first for _, first, _, _ in saves()] == [0, 2, 4]  # b again, when it finished
    assert saves() == []


def test_without_tiers_nothing_is_planned():
    scheduler, _ = make(None)
    scheduler.add_request(req("a", 21))
    out = scheduler.schedule()
    assert out.kv_loads == [] and out.scheduled[0].start_pos == 0
    assert scheduler.take_saves() == []
