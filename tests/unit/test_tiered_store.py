"""TieredStore without torch: entries keyed by their last block, lookups across tiers, device
hits mid-entry, sequences that share a prefix, cuts, faults as misses, promotion, write
planning (the cost model alone: test_cost_model.py)."""

from __future__ import annotations

import threading

import pytest

from kvwise.core.kv_events import BlockRemoved, BlockStored
from kvwise.store import serde
from kvwise.store.host import HostStore
from kvwise.store.tiered import TieredStore
from tests.store_util import (
    FMT,
    Flaky,
    chain,
    entry_format,
    fork,
    load,
    make_store,
    payload,
    write_all,
)


def test_writes_are_aligned_entries_keyed_by_their_last_block():
    store = make_store(HostStore(1 << 20))
    h = chain(10)
    writes = write_all(store, h)
    assert [(w.first_block, len(w.block_hashes)) for w in writes] == [(0, 4), (4, 4), (8, 2)]
    assert [w.key for w in writes] == [h[3], h[7], h[9]]
    # each entry is stored once per layer group, under keys derived from its last block
    host = store.tiers[0]
    assert host.contains([FMT.entry_key(h[7], g) for g in (0, 1)]) == [True, True]
    assert host.contains([FMT.entry_key(h[4], 0), h[7]]) == [False, False]
    # the same sequence again: nothing new to write; grown by a block: only its new last
    # entry, beside (not over) the old one
    assert store.plan_writes(h, 10) == []
    grown = h + chain(11)[10:]
    writes = write_all(store, grown)
    assert [(w.first_block, len(w.block_hashes), w.key) for w in writes] == [(8, 3, grown[10])]
    assert host.contains([FMT.entry_key(h[9], 0), FMT.entry_key(grown[10], 0)]) == [True, True]
    assert load(store, h, 0, 10, 41)[1] == 10
    assert load(store, grown, 0, 11, 45)[1] == 11


def test_short_sequences_are_not_written():
    store = make_store(HostStore(1 << 20), min_tokens=17)  # block_size 4: 5 blocks needed
    assert store.plan_writes(chain(4), 4) == []
    assert len(store.plan_writes(chain(5), 5)) == 2


def test_a_device_hit_mid_entry_loads_the_rest_of_it_and_a_divergence_mid_entry_misses_it():
    store = make_store(HostStore(1 << 20))
    h = chain(10)
    write_all(store, h)
    # the same prompt, its first 2 blocks on the device: the rest of the first entry (its
    # 2 leading blocks skipped), then the other entries whole
    plan, loaded, reads = load(store, h, device=2, max_blocks=10, prompt_tokens=41)
    assert [(c.first_block, c.num_blocks) for c in plan.chunks] == [(2, 2), (4, 4), (8, 2)]
    assert loaded == 8  # blocks 2..9
    for group in reads:
        assert [(r.entry_blocks, r.skip, r.usable) for r in group] == [
            (4, 2, 2),
            (4, 0, 4),
            (2, 0, 2),
        ]
    first_layer_bytes = 4 * 32  # layer 0 of the first entry: K of 4 blocks (32 bytes each)
    assert bytes(reads[0][0].payload[:first_layer_bytes]) == payload(h[0:4])[:first_layer_bytes]
    # a prompt that shares 6 blocks, then diverges inside the entry of blocks 4..7: no entry
    # of it ends with the prompt's block 7, so its plan stops before that entry
    other = fork(h, 6, "b")
    plan, loaded, reads = load(store, other, device=2, max_blocks=10, prompt_tokens=41)
    assert [(c.first_block, c.num_blocks, c.key) for c in plan.chunks] == [(2, 2, h[3])]
    assert plan.num_blocks == 2 and loaded == 2
    assert [(r.skip, r.usable) for r in reads[0]] == [(2, 2)]
    assert store.tiers[0].stats.faults == 0


def test_sequences_sharing_their_first_blocks_keep_their_own_entries():
    host = HostStore(1 << 20)
    store = make_store(host)
    a = chain(10)
    b = fork(a, 6, "b")  # shares blocks 0..5, so the entry of blocks 4..7 differs
    write_all(store, a)
    # b's entry of blocks 0..3 is a's (the same prefix); the others are b's own
    assert [(w.first_block, w.key) for w in write_all(store, b)] == [(4, b[7]), (8, b[9])]
    ends = [a[3], a[7], a[9], b[7], b[9]]  # nothing overwritten: 5 entries, 2 groups each
    assert host.contains([FMT.entry_key(e, g) for e in ends for g in (0, 1)]) == [True] * 10
    for seq in (a, b):
        plan, loaded, reads = load(store, seq, 0, 10, 41)
        assert loaded == 10 and [c.key for c in plan.chunks] == [seq[3], seq[7], seq[9]]
        for i, (first, end) in enumerate(((0, 4), (4, 8), (8, 10))):
            layer0 = (end - first) * 2 * 32  # K and V of layer 0, 32 bytes a block
            assert bytes(reads[0][i].payload) == payload(seq[first:end])[:layer0]
    # and a fresh store over the same tier (no known map) finds both whole
    fresh = make_store(host)
    assert load(fresh, a, 0, 10, 41)[1] == load(fresh, b, 0, 10, 41)[1] == 10
    assert host.stats.faults == 0


def test_a_cut_lets_a_prompt_sharing_exactly_the_blocks_before_it_load_them():
    store = make_store(HostStore(1 << 20))
    h = chain(10)
    writes = write_all(store, h, cuts=(6,))  # e.g. the writer's prompt ended after block 5
    assert [(w.first_block, len(w.block_hashes)) for w in writes] == [
        (0, 4),
        (4, 2),
        (6, 2),
        (8, 2),
    ]
    other = fork(h, 6, "b")
    plan, loaded, reads = load(store, other, 0, 10, 41)
    assert [(c.first_block, c.num_blocks, c.key) for c in plan.chunks] == [
        (0, 4, h[3]),
        (4, 2, h[5]),
    ]
    assert plan.num_blocks == loaded == 6
    assert [(r.skip, r.usable) for r in reads[1]] == [(0, 4), (0, 2)]
    # the sequence itself loads whole, through every end
    plan, loaded, _ = load(store, h, 0, 10, 41)
    assert loaded == 10 and [c.key for c in plan.chunks] == [h[3], h[5], h[7], h[9]]
    # without the cut, the prompt finds the first entry only
    uncut = make_store(HostStore(1 << 20))
    write_all(uncut, h)
    assert load(uncut, other, 0, 10, 41)[1] == 4


def test_an_entry_that_starts_after_the_planned_run_is_a_miss_not_a_fault():
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(8)
    write_all(store, h, cuts=(2,))  # entries of blocks 0..1, 2..3, 4..7
    host.delete([FMT.entry_key(h[1], g) for g in (0, 1)])  # evicted, say
    plan, loaded, reads = load(store, h, 0, 8, 33)
    # the planner cannot tell where an entry starts: it takes the one ending at block 3 ...
    assert [(c.first_block, c.num_blocks, c.key) for c in plan.chunks] == [
        (0, 4, h[3]),
        (4, 4, h[7]),
    ]
    # ... which starts at block 2: nothing of it is usable, and nothing is loaded after it
    assert [r.usable for group in reads for r in group] == [0, 4, 0, 4]
    assert loaded == 0
    assert host.stats.faults == 0
    assert host.contains([FMT.entry_key(h[3], g) for g in (0, 1)]) == [True, True]  # kept
    # a device hit of 2 blocks still gets the rest from it
    assert load(store, h, 2, 8, 33)[1] == 6


def test_load_respects_max_blocks_and_a_missing_entry():
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(12)
    write_all(store, h)
    assert load(store, h, 0, max_blocks=8, prompt_tokens=33)[1] == 8
    # an entry that ends past max_blocks is not used in part
    assert load(store, h, 0, max_blocks=7, prompt_tokens=29)[1] == 4
    host.delete([FMT.entry_key(h[7], 1)])  # one layer group of the second entry
    plan, loaded, _ = load(store, h, 0, max_blocks=12, prompt_tokens=49)
    assert plan.num_blocks == 4 and loaded == 4


def test_disk_reads_land_straight_in_the_destination(tmp_path):
    from kvwise.store.disk import DiskStore

    disk = DiskStore(tmp_path, 1 << 20)
    store = make_store(disk)
    h = chain(8)
    write_all(store, h)
    layer_bytes = 32  # one block's K (or V) in one layer
    targets: dict[tuple[int, int], list[list[bytearray]]] = {}

    def dest_for(plan):
        def dest(i: int, entry_blocks: int) -> list[bytearray] | None:
            if entry_blocks < plan.chunks[i].num_blocks:
                return None  # too short to hold the run (as the engine's dest)
            views = [bytearray(entry_blocks * layer_bytes) for _ in range(2)]  # K, V: 1 layer
            targets.setdefault((i, entry_blocks), []).append(views)  # group 0 first, then 1
            return views

        return dest

    plan, loaded, reads = load(store, h, 1, 8, 33, dest_for)
    assert loaded == 7 and all(r.in_place for group in reads for r in group)
    assert [r.skip for r in reads[0]] == [1, 0]
    # the first entry, layer group 0 (layer 0): K then V of its 4 blocks, block 0 included
    k0, v0 = targets[(0, 4)][0]
    expected = payload(h[0:4])  # 4 blocks × 128 bytes: layer 0 K, layer 0 V, layer 1 K, ...
    assert bytes(k0) + bytes(v0) == expected[: 2 * 4 * layer_bytes]
    # a flipped byte on disk is caught where the bytes landed
    path = disk.file_path(FMT.entry_key(h[7], 1))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    _, loaded, _ = load(store, h, 1, 8, 33, dest_for)
    assert loaded == 3 and disk.stats.faults == 1


def test_tenants_never_share_entries():
    store = make_store(HostStore(1 << 20))
    write_all(store, chain(8, "tenant-a"))
    assert store.plan_load("r", chain(8, "tenant-b"), 0, 8, 33) is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda v: v[: len(v) // 2],  # truncated
        lambda v: v[:-1] + bytes([v[-1] ^ 1]),  # bit flip in the payload
        lambda v: v.replace(b"KVWS", b"KVWX", 1),  # foreign format
    ],
)
def test_a_damaged_entry_is_a_fault_and_a_miss(damage):
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(8)
    write_all(store, h)
    key = FMT.entry_key(h[7], 0)
    (value,) = host.get([key])
    host.put([(key, damage(bytes(value)))])
    assert load(store, h, 0, 8, 33)[1] == 4  # the first entry only
    assert host.stats.faults == 1
    assert host.contains([key]) == [False]  # deleted


def test_entry_of_another_model_is_refused():
    host = HostStore(1 << 20)
    h = chain(4)
    other_fmt = entry_format("model-y")
    for g in range(2):
        part = payload(h)[g * 256 : (g + 1) * 256]  # one layer of 4 blocks
        host.put([(FMT.entry_key(h[3], g), serde.pack(other_fmt, h, 0, g, part))])
    store = make_store(host)
    assert load(store, h + chain(1, "z"), 0, 4, 17)[1] == 0
    assert host.stats.faults == 2


def test_lower_tier_hits_are_promoted_and_dead_tiers_are_misses():
    upper, lower = Flaky("host"), Flaky("disk")
    store = make_store(upper, lower)
    h = chain(8)
    write_all(store, h)
    keys = [FMT.entry_key(h[e], g) for e in (3, 7) for g in (0, 1)]
    upper.delete(keys)
    plan, loaded, _ = load(store, h, 0, 8, 33)
    assert loaded == 8 and {t for c in plan.chunks for t in c.tiers} == {"disk"}
    assert upper.contains(keys) == [True] * 4  # promoted
    upper.down = True
    lower.down = True
    assert load(store, h, 0, 8, 33)[1] == 0  # planned (contains says yes), read fails
    assert upper.stats.faults >= 1


def test_policy_never_loads_nothing_and_decisions_are_recorded():
    store = make_store(HostStore(1 << 20), policy="never")
    h = chain(8)
    write_all(store, h)
    assert store.plan_load("r", h, 0, 8, 33) is None
    store.policy = "always"
    store.plan_load("r", h, 0, 8, 33)
    decision = store.decisions[-1]
    assert (decision.available_tokens, decision.chosen_tokens) == (32, 32)
    assert store.stats().load_decisions == 1


def test_auto_policy_follows_the_cost_model():
    store = make_store(HostStore(1 << 20), policy="auto")
    h = chain(8)
    write_all(store, h)
    store.cost.tier_fit("host").w = [10.0, 0.0, 0.0]  # 10 s per read: never worth it
    assert store.plan_load("r", h, 0, 8, 33) is None
    assert store.stats().recompute_decisions == 1
    assert store.decisions[-1].recomputed_instead
    store.cost.tier_fit("host").w = [0.0, 0.0, 0.0]  # free reads: always worth it
    assert store.plan_load("r", h, 0, 8, 33).num_blocks == 8


def test_background_writer_flushes_on_close_and_drops_when_full():
    host = HostStore(1 << 20)
    store = TieredStore([host], FMT, chunk_blocks=4, min_tokens=4, max_pending_bytes=600)
    gate = threading.Event()
    real_put = host.put
    host.put = lambda items, ttl_s=None, owner=None: (gate.wait(5), real_put(items, ttl_s))
    h = chain(12)
    writes = store.plan_writes(h, 12)
    for w in writes:  # 512 bytes each: the second does not fit while the first is pending
        store.write(w, payload(list(w.block_hashes)))
    assert store.stats().writes_dropped >= 1
    gate.set()
    store.flush()
    assert host.contains([FMT.entry_key(h[3], 0), FMT.entry_key(h[3], 1)]) == [True, True]
    assert store.stats().chunks_written == 1
    store.close()
    store.close()  # idempotent


def test_num_stored_blocks_counts_the_leading_stored_run():
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(10)
    write_all(store, h)
    assert store.num_stored_blocks(h, 10) == 10
    assert store.num_stored_blocks(h, 9) == 8  # the last entry ends at block 9
    host.delete([FMT.entry_key(h[7], 1)])
    assert store.num_stored_blocks(h, 10) == 4


# ---- the facade: KVTierPlanner, roll back, forgetting corrupt chunks, typed stats --------


def test_tiered_store_implements_the_scheduler_protocol():
    import inspect

    from kvwise.core.kv_tiers import KVTierPlanner

    store = make_store(HostStore(1 << 20))
    assert isinstance(store, KVTierPlanner)
    for name in ("plan_load", "roll_back", "plan_writes"):
        want = inspect.signature(getattr(KVTierPlanner, name)).parameters
        got = inspect.signature(getattr(store, name)).parameters  # bound: no self
        assert list(got) == list(want)[1:], name


def test_roll_back_makes_the_undelivered_chunks_writable_again():
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(12)
    write_all(store, h)
    assert store.plan_writes(h, 12) == []
    plan = store.plan_load("r", h, 0, 12, 49)
    assert [c.first_block for c in plan.chunks] == [0, 4, 8]
    store.roll_back(plan, 5)  # blocks 0..3 arrived whole, 4..7 only in part, 8..11 not
    writes = store.plan_writes(h, 12)
    assert [(w.first_block, w.num_tiers) for w in writes] == [(4, None), (8, None)]
    assert store.plan_writes(h, 12) == []  # remembered as written again


def test_a_corrupt_entry_is_forgotten_so_it_is_written_again():
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(8)
    write_all(store, h)
    key = FMT.entry_key(h[7], 1)
    (value,) = host.get([key])
    host.put([(key, value[:-1] + bytes([value[-1] ^ 1]))])
    assert load(store, h, 0, 8, 33)[1] == 4
    writes = store.plan_writes(h, 8)
    assert [(w.first_block, w.num_tiers) for w in writes] == [(4, None)]
    store.write(writes[0], payload(list(writes[0].block_hashes)))
    assert load(store, h, 0, 8, 33)[1] == 8


def test_stats_are_typed_and_the_tiers_are_snapshots():
    host = HostStore(1 << 20)
    store = make_store(host)
    h = chain(8)
    write_all(store, h)
    before = store.stats()
    assert list(before.tiers) == ["host"]
    assert before.tiers["host"] is not host.stats
    assert before.tiers["host"].bytes_written == host.stats.bytes_written > 0
    assert (before.chunks_written, before.writes_dropped, before.pending_write_bytes) == (2, 0, 0)
    load(store, h, 0, 8, 33)
    store.count_loaded(8)
    after = store.stats()
    assert before.tiers["host"].hits == 0 and after.tiers["host"].hits == 4
    assert (after.load_decisions, after.recompute_decisions, after.loaded_tokens) == (1, 0, 32)
    with pytest.raises(AttributeError):
        after.loaded_tokens = 0  # frozen


def test_observations_reach_the_cost_model():
    store = make_store(HostStore(1 << 20))
    updates = (store.cost.step.num_updates, store.cost.copy.num_updates)
    store.observe_step([(0, 64)], 0.01)
    store.observe_copy(1 << 20, 0.001)
    assert (store.cost.step.num_updates, store.cost.copy.num_updates) == (
        updates[0] + 1,
        updates[1] + 1,
    )


def test_policy_is_checked_when_set():
    store = make_store(HostStore(1 << 20))
    with pytest.raises(ValueError, match="policy"):
        store.policy = "sometimes"
    assert store.policy == "always"


def test_a_chunk_a_tier_failed_to_store_is_written_again():
    store = make_store(HostStore(1 << 20), HostStore(100))  # the second tier stores nothing
    h = chain(8)
    assert [w.first_block for w in write_all(store, h)] == [0, 4]
    # only confirmed writes are remembered: both chunks are planned again next time
    assert [w.first_block for w in store.plan_writes(h, 8)] == [0, 4]
    ok = make_store(HostStore(1 << 20))
    write_all(ok, h)
    assert ok.plan_writes(h, 8) == []


def test_tier_events_report_the_chunks_each_tier_gains_and_loses():
    probe = make_store(HostStore(1 << 20))
    write_all(probe, chain(8))
    two_chunks = probe.tiers[0].stats.snapshot().num_bytes  # two chunks, both layer groups
    host = HostStore(two_chunks)
    store = make_store(host)
    assert store.take_tier_events() == []  # not recording: nothing
    write_all(store, chain(4))
    assert store.take_tier_events() == []
    store.record_events()
    h = chain(12)
    write_all(store, h)  # 3 chunks into room for 2: the oldest ones go
    events = store.take_tier_events()
    assert events == [BlockStored(h[4:8], None, 4, "host"), BlockStored(h[8:12], None, 4, "host")]
    # h[:4] (= chain(4)) was written before recording: not stored now, and its eviction to
    # make room is not reported either
    write_all(store, chain(20))  # two more chunks: h's two are evicted
    later = store.take_tier_events()
    assert all(e.medium == "host" for e in later)
    gone = [e.block_hashes for e in later if isinstance(e, BlockRemoved)]
    assert h[4:8] in gone and h[8:12] in gone
    assert len(gone) == len({tuple(g) for g in gone})  # a chunk is removed once, not per group
    assert store.take_tier_events() == []
