"""The tiered store's planner on its own: where entries are found (every block after the
device hit asked for an entry ending there, batched per tier), what is planned, the known
map, ``roll_back`` and write plans (entries keyed by their last block, cut at multiples of
``chunk_blocks``, at the end and at the writer's cuts)."""

from __future__ import annotations

import pytest

from kvwise.core.kv_tiers import LoadPlan, PlannedChunk
from kvwise.store.costmodel import CostModel
from kvwise.store.host import HostStore
from kvwise.store.planner import ChunkPlanner, KnownChunks
from tests.store_util import chain, entry_format, fork

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


def store_entry(tier: HostStore, hashes: list[bytes], groups=(0, 1)) -> None:
    """Mark an entry as stored under its last block's key (planning reads only keys; the
    values are never read)."""
    tier.put([(FMT.entry_key(hashes[-1], g), b"entry") for g in groups])


def planner(*tiers, policy="always", min_tokens=4) -> ChunkPlanner:
    return ChunkPlanner(list(tiers), FMT, CostModel(), chunk_blocks=4, min_tokens=min_tokens,
                        policy=policy)  # fmt: skip


def runs(plan: LoadPlan) -> list[tuple[int, int]]:
    return [(c.first_block, c.num_blocks) for c in plan.chunks]


def test_entries_are_located_with_two_batched_contains_per_tier_at_most():
    top, bottom = CountingHost("host"), CountingHost("disk")
    h = chain(14)
    store_entry(top, h[0:4])
    store_entry(bottom, h[4:8])
    store_entry(top, h[8:12], groups=(0,))
    store_entry(bottom, h[8:12], groups=(1,))
    plan = planner(top, bottom).plan_load("r", h, 2, 13, 53)
    # group 0 of an entry ending at each of blocks 2 .. 12: 11 keys to the top tier, the 9
    # it lacks to the one below; then group 1 of the 3 ends found: 3 keys, 2 of them below
    assert (top.batches, bottom.batches) == ([11, 3], [9, 2])
    # the device hit ends mid-entry: the first run loads blocks 2, 3 of the entry ending at 3
    assert runs(plan) == [(2, 2), (4, 4), (8, 4)]
    assert [c.key for c in plan.chunks] == [h[3], h[7], h[11]]
    assert [c.tiers for c in plan.chunks] == [("host", "host"), ("disk", "disk"), ("host", "disk")]
    assert plan.chunks[0].block_hashes == tuple(h[2:4])
    assert plan.chunks[1].block_hashes == tuple(h[4:8])
    assert plan.num_blocks == 10  # blocks 2 .. 11; no entry ends at block 12


def test_a_load_takes_every_present_end_in_order():
    host = HostStore(1 << 20)
    h = chain(10)
    for first, end in ((0, 4), (4, 6), (6, 8), (4, 8), (8, 10)):  # e.g. two writers' cuts
        store_entry(host, h[first:end])
    p = planner(host)
    plan = p.plan_load("r", h, 0, 10, 41)
    assert runs(plan) == [(0, 4), (4, 2), (6, 2), (8, 2)]
    assert [c.key for c in plan.chunks] == [h[3], h[5], h[7], h[9]]
    # a device hit inside the run ending at block 5: the rest of it, then the next ends
    assert runs(p.plan_load("r", h, 5, 10, 41)) == [(5, 1), (6, 2), (8, 2)]


def test_nothing_to_plan():
    host = HostStore(1 << 20)
    h = chain(8)
    store_entry(host, h[0:4])
    assert planner(host).plan_load("r", h, 8, 8, 33) is None  # all on the device already
    assert planner(host, policy="never").plan_load("r", h, 0, 8, 33) is None
    assert planner().plan_load("r", h, 0, 8, 33) is None  # no tiers
    assert planner(host).plan_load("r", h, 4, 8, 33) is None  # no entry ends after block 3
    # a prompt that stops inside the stored entry does not use part of it
    assert planner(host).plan_load("r", h, 0, 3, 13) is None
    assert planner(host).plan_load("r", fork(h, 3, "b"), 0, 8, 33) is None


def test_decisions_are_recorded_and_counted():
    host = HostStore(1 << 20)
    h = chain(8)
    store_entry(host, h[0:4])
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


def test_roll_back_forgets_every_entry_not_delivered_whole():
    p = planner(HostStore(1 << 20))
    h = chain(12)
    assert len(p.plan_writes(h, 12)) == 3
    assert p.plan_writes(h, 12) == []
    chunks = [PlannedChunk(1, 3, tuple(h[1:4]), ("host", "host"))]  # a device hit of 1 block
    chunks += [PlannedChunk(f, 4, tuple(h[f : f + 4]), ("host", "host")) for f in (4, 8)]
    plan = LoadPlan(11, chunks)
    p.roll_back(plan, 11)  # all delivered: nothing forgotten
    assert p.plan_writes(h, 12) == []
    p.roll_back(plan, 7)  # the runs ending at blocks 3 and 7 whole (3 + 4 blocks), not 11
    assert [w.first_block for w in p.plan_writes(h, 12)] == [8]
    p.roll_back(plan, 0)
    assert [w.first_block for w in p.plan_writes(h, 12)] == [0, 4, 8]


def test_write_plans_are_cut_at_chunk_multiples_the_end_and_each_cut():
    h = chain(10)
    writes = planner(HostStore(1 << 20)).plan_writes(h, 10, cuts=(6,))
    assert [(w.first_block, len(w.block_hashes)) for w in writes] == [
        (0, 4),
        (4, 2),
        (6, 2),
        (8, 2),
    ]
    assert [w.key for w in writes] == [h[3], h[5], h[7], h[9]]
    assert all(w.key == w.block_hashes[-1] for w in writes)
    # cuts outside (0, num_full_blocks), repeated or on a multiple change nothing
    writes = planner(HostStore(1 << 20)).plan_writes(h, 9, cuts=(0, 2, 2, 4, 9, 12, -1))
    assert [(w.first_block, len(w.block_hashes)) for w in writes] == [
        (0, 2),
        (2, 2),
        (4, 4),
        (8, 1),
    ]


def test_write_plans_skip_known_entries_and_fill_in_missing_upper_tiers():
    p = planner(HostStore(1 << 20), HostStore(1 << 20), min_tokens=17)
    h = chain(10)
    assert p.plan_writes(h, 4) == []  # 16 tokens: under min_tokens
    assert [(w.first_block, len(w.block_hashes)) for w in p.plan_writes(h, 10)] == [
        (0, 4),
        (4, 4),
        (8, 2),
    ]
    # a hit read in place from the second tier: write it to the first tier only
    p.known.remember(h[3], missing_above=1)
    assert [(w.first_block, w.num_tiers) for w in p.plan_writes(h, 10)] == [(0, 1)]
    # a sequence sharing the first 6 blocks: its entries after the shared one are its own
    other = fork(h, 6, "b")
    writes = p.plan_writes(other, 10)
    assert [(w.first_block, w.num_tiers, w.key) for w in writes] == [
        (4, None, other[7]),
        (8, None, other[9]),
    ]
    # cut elsewhere: only the new end is written; the run 6..7 ends where a known entry ends
    assert [(w.first_block, w.key) for w in p.plan_writes(h, 10, cuts=(6,))] == [(4, h[5])]


def test_known_chunks_are_bounded_least_recently_remembered_first():
    known = KnownChunks(max_chunks=2)
    a, b, c = chain(3)
    known.remember(a)
    known.remember(b)
    known.remember(a)  # refreshed
    known.remember(c, missing_above=2)
    assert (known.get(a), known.get(b), known.get(c)) == (0, None, 2)
    known.forget(a)
    known.forget(a)  # absent: ignored
    assert known.get(a) is None and len(known) == 1


def test_num_stored_blocks_counts_the_leading_run_every_group():
    host = HostStore(1 << 20)
    h = chain(10)
    store_entry(host, h[0:4])
    store_entry(host, h[4:8], groups=(0,))
    store_entry(host, h[8:10])
    p = planner(host)
    assert p.num_stored_blocks(h, 10) == 4
    store_entry(host, h[4:8], groups=(1,))
    assert p.num_stored_blocks(h, 10) == 10
    assert p.num_stored_blocks(h, 9) == 8  # the entry ending at block 9 is not used in part


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        planner(policy="sometimes")
