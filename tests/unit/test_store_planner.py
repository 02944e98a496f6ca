"""The tiered store's planner on its own: where chunks are found (one batched ``contains``
per tier), what is planned, the known map, ``roll_back`` and write plans."""

from __future__ import annotations

import pytest

from kvwise.core.kv_tiers import LoadPlan, PlannedChunk
from kvwise.store import serde
from kvwise.store.costmodel import CostModel
from kvwise.store.host import HostStore
from kvwise.store.planner import ChunkPlanner, KnownChunks
from tests.store_util import chain, entry_format

FMT = entry_format()  # 2 layer groups, 4-token blocks


class CountingHost(HostStore):
    """A host tier that records each ``contains`` batch."""

    def __init__(self, name: str = "host") -> None:
        super().__init__(1 << 20)
        self.name = name
        self.batches: list[int] = []

    def contains(self, keys):
        self.batches.append(len(keys))
        return super().contains(keys)


def store_chunk(tier: HostStore, hashes: list[bytes], groups=(0, 1)) -> None:
    """Mark a chunk as stored (planning reads only keys; the values are never read)."""
    tier.put([(serde.entry_key(hashes[0], g), b"entry") for g in groups])


def planner(*tiers, policy="always", min_tokens=4) -> ChunkPlanner:
    return ChunkPlanner(list(tiers), FMT, CostModel(), chunk_blocks=4, min_tokens=min_tokens,
                        policy=policy)  # fmt: skip


def test_chunks_are_located_with_one_batched_contains_per_tier():
    top, bottom = CountingHost("host"), CountingHost("disk")
    h = chain(14)
    store_chunk(top, h[0:4])
    store_chunk(bottom, h[4:8])
    store_chunk(top, h[8:12], groups=(0,))
    store_chunk(bottom, h[8:12], groups=(1,))
    plan = planner(top, bottom).plan_load("r", h, 2, 13, 53)
    # chunks 0, 4, 8, 12: 8 keys to the top tier, the 5 it lacks to the one below
    assert (top.batches, bottom.batches) == ([8], [5])
    assert [(c.first_block, c.skip, c.num_blocks) for c in plan.chunks] == [
        (0, 2, 2),
        (4, 0, 4),
        (8, 0, 4),
    ]
    assert [c.tiers for c in plan.chunks] == [("host", "host"), ("disk", "disk"), ("host", "disk")]
    assert plan.chunks[1].block_hashes == tuple(h[4:8])
    assert plan.num_blocks == 10  # blocks 2 .. 11; chunk 12 is not stored


def test_nothing_to_plan():
    host = HostStore(1 << 20)
    h = chain(8)
    store_chunk(host, h[0:4])
    assert planner(host).plan_load("r", h, 8, 8, 33) is None  # all on the device already
    assert planner(host, policy="never").plan_load("r", h, 0, 8, 33) is None
    assert planner().plan_load("r", h, 0, 8, 33) is None  # no tiers
    assert planner(host).plan_load("r", h, 4, 8, 33) is None  # chunk 4 is in no tier


def test_decisions_are_recorded_and_counted():
    host = HostStore(1 << 20)
    h = chain(8)
    store_chunk(host, h[0:4])
    p = planner(host, policy="auto")
    p.cost.tier_fit("host").w = [10.0, 0.0, 0.0]  # 10 s a read: recompute
    assert p.plan_load("r1", h, 0, 8, 33) is None
    p.policy = "always"
    assert p.plan_load("r2", h, 1, 8, 33).num_blocks == 3
    assert (p.load_decisions, p.recompute_decisions) == (1, 1)
    first, second = p.decisions
    assert (first.request_id, first.available_tokens, first.chosen_tokens) == ("r1", 16, 0)
    assert (second.start_tokens, second.available_tokens, second.chosen_tokens) == (4, 12, 12)
    assert second.tiers == ("host",)


def test_roll_back_forgets_every_chunk_not_delivered_whole():
    p = planner(HostStore(1 << 20))
    h = chain(12)
    assert len(p.plan_writes(h, 12)) == 3
    assert p.plan_writes(h, 12) == []
    chunks = [PlannedChunk(f, 1 if f == 0 else 0, 3 if f == 0 else 4, tuple(h[f : f + 4]),
                           ("host", "host")) for f in (0, 4, 8)]  # fmt: skip
    plan = LoadPlan(11, chunks)
    p.roll_back(plan, 11)  # all delivered: nothing forgotten
    assert p.plan_writes(h, 12) == []
    p.roll_back(plan, 7)  # chunks 0 and 4 whole (3 + 4 blocks), chunk 8 not
    assert [w.first_block for w in p.plan_writes(h, 12)] == [8]
    p.roll_back(plan, 0)
    assert [w.first_block for w in p.plan_writes(h, 12)] == [0, 4, 8]


def test_write_plans_skip_known_chunks_and_fill_in_missing_upper_tiers():
    p = planner(HostStore(1 << 20), HostStore(1 << 20), min_tokens=17)
    h = chain(10)
    assert p.plan_writes(h, 4) == []  # 16 tokens: under min_tokens
    assert [(w.first_block, len(w.block_hashes)) for w in p.plan_writes(h, 10)] == [
        (0, 4),
        (4, 4),
        (8, 2),
    ]
    # a hit read in place from the second tier: write it to the first tier only
    p.known.remember(h[0], h[3], missing_above=1)
    assert [(w.first_block, w.num_tiers) for w in p.plan_writes(h, 10)] == [(0, 1)]
    # another conversation's chunk under the same first block: rewrite it everywhere
    p.known.remember(h[4], chain(8, "b")[7])
    assert [(w.first_block, w.num_tiers) for w in p.plan_writes(h, 10)] == [(4, None)]


def test_known_chunks_are_bounded_least_recently_remembered_first():
    known = KnownChunks(max_chunks=2)
    a, b, c = chain(3)
    known.remember(a, a)
    known.remember(b, b)
    known.remember(a, a)  # refreshed
    known.remember(c, c)
    assert (known.get(a), known.get(b), known.get(c)) == ((a, 0), (None, 0), (c, 0))
    known.forget(a)
    known.forget(a)  # absent: ignored
    assert known.get(a) == (None, 0) and len(known) == 1


def test_num_stored_blocks_counts_the_leading_run_every_group():
    host = HostStore(1 << 20)
    h = chain(10)
    store_chunk(host, h[0:4])
    store_chunk(host, h[4:8], groups=(0,))
    store_chunk(host, h[8:10])
    p = planner(host)
    assert p.num_stored_blocks(h, 10) == 4
    store_chunk(host, h[4:8], groups=(1,))
    assert p.num_stored_blocks(h, 10) == 10
    assert p.num_stored_blocks(h, 9) == 9


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        planner(policy="sometimes")
