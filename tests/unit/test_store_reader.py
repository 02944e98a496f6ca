"""The tiered store's reader on its own: checks and matching, corrupt and misplaced entries
as faults, entries that start too late as misses, promotion, and reading in place
(``ReadsInPlace``: disk is one, host and Redis are not)."""

from __future__ import annotations

import pytest

from kvwise.core.kv_tiers import PlannedChunk
from kvwise.store import serde
from kvwise.store.base import KVStore, ReadsInPlace
from kvwise.store.costmodel import CostModel
from kvwise.store.disk import DiskStore
from kvwise.store.host import HostStore
from kvwise.store.planner import KnownChunks
from kvwise.store.reader import Reader
from kvwise.store.redis import RedisStore
from tests.store_util import chain, entry_format, payload

FMT = entry_format()  # 2 layer groups (one layer each), 4-token blocks of 128 bytes


def put_entry(tier: KVStore, hashes: list[bytes], first_block: int = 0) -> None:
    """Store an entry as the writer would: one per layer group, keyed by its last block."""
    data = payload(hashes)
    size = len(hashes) * FMT.group_block_bytes(0)
    tier.put([
        (FMT.entry_key(hashes[-1], g),
         serde.pack(FMT, hashes, first_block, g, data[g * size : (g + 1) * size]))
        for g in (0, 1)
    ])  # fmt: skip


def planned(hashes: list[bytes], first_block: int = 0, tiers=("host", "host")) -> PlannedChunk:
    """The run of blocks ``first_block ..`` with these hashes, read from the entry ending
    with its last block."""
    return PlannedChunk(first_block, len(hashes), tuple(hashes), tiers)


class Setup:
    def __init__(self, *tiers: KVStore) -> None:
        self.known = KnownChunks()
        self.promoted: list[tuple[int, bytes]] = []
        self.reader = Reader(list(tiers), FMT, self.known, CostModel(),
                             lambda i, key, value: self.promoted.append((i, key)))  # fmt: skip


def test_reads_are_checked_and_matched_against_the_prompt():
    host = HostStore(1 << 20)
    h = chain(8)
    put_entry(host, h[0:4])
    put_entry(host, h[4:8], first_block=4)
    s = Setup(host)
    # blocks 1..3 of the first entry (block 0 is on the device); a prompt whose hash of
    # block 6 differs from the stored one (no real chain meets again: a bad store could)
    other = h[:6] + chain(7, "b")[6:7] + h[7:8]
    reads = s.reader.read_group([planned(h[1:4], 1), planned(other[4:8], 4)], 0)
    assert [(r.entry_blocks, r.skip, r.usable, r.in_place) for r in reads] == [
        (4, 1, 3, False),
        (4, 0, 2, False),
    ]
    assert bytes(reads[0].payload) == payload(h[0:4])[:256]  # the whole entry's layer 0
    # group 0 hits are remembered as stored, by their last block
    assert s.known.get(h[3]) == 0 and s.known.get(h[7]) == 0
    assert s.promoted == []  # a top-tier hit is not promoted
    assert host.stats.faults == 0
    s.reader.close()


def test_a_corrupt_entry_is_a_fault_deleted_and_forgotten():
    host = HostStore(1 << 20)
    h = chain(4)
    put_entry(host, h)
    key = FMT.entry_key(h[3], 1)
    (value,) = host.get([key])
    host.put([(key, value[:-1] + bytes([value[-1] ^ 1]))])  # a flipped tag bit
    s = Setup(host)
    chunk = planned(h)
    assert s.reader.read_group([chunk], 0)[0].usable == 4
    assert s.known.get(h[3]) == 0
    hits = host.stats.hits
    (read,) = s.reader.read_group([chunk], 1)
    assert (read.payload, read.usable) == (None, 0)
    assert host.stats.faults == 1 and host.stats.hits == hits  # a fault, not also a hit
    assert host.contains([key]) == [False]  # deleted
    assert s.known.get(h[3]) is None  # forgotten: the entry gets written again
    s.reader.close()


def test_an_entry_ending_elsewhere_than_the_run_is_a_fault():
    host = HostStore(1 << 20)
    h = chain(4)
    put_entry(host, h, first_block=8)  # stored as blocks 8..11 of some sequence
    s = Setup(host)
    assert s.reader.read_group([planned(h)], 0)[0].usable == 0  # the run ends at block 3
    assert host.stats.faults == 1 and host.contains([FMT.entry_key(h[3], 0)]) == [False]
    s.reader.close()


def dest_for(chunks: list[PlannedChunk]):
    """Buffers for each run's entry, as the engine's: K and V of one layer, the entry's
    leading blocks included; None when the entry is too short to hold the run."""

    def dest(i: int, entry_blocks: int) -> list[bytearray] | None:
        if entry_blocks < chunks[i].num_blocks:
            return None
        return [bytearray(entry_blocks * 32) for _ in range(2)]

    return dest


@pytest.mark.parametrize("reads", ["into memory", "into buffers", "in place"])
def test_an_entry_that_starts_after_the_run_is_a_miss_not_a_fault(tmp_path, reads):
    tier = DiskStore(tmp_path, 1 << 20) if reads == "in place" else HostStore(1 << 20)
    h = chain(4)
    put_entry(tier, h[2:4], first_block=2)  # another writer cut the sequence after block 1
    s = Setup(tier)
    chunks = [planned(h, tiers=(tier.name, tier.name))]  # blocks 0..3
    dest = None if reads == "into memory" else dest_for(chunks)
    for group in (0, 1):
        (read,) = s.reader.read_group(chunks, group, dest)
        assert (read.payload, read.usable, read.skip) == (None, 0, 0)
    assert tier.stats.faults == 0
    assert tier.contains([FMT.entry_key(h[3], g) for g in (0, 1)]) == [True, True]  # kept
    assert s.known.get(h[3]) is None  # not remembered as a hit either
    # the same entry serves a run that starts where it does
    chunks = [planned(h[2:4], 2, (tier.name, tier.name))]
    dest = None if reads == "into memory" else dest_for(chunks)
    (read,) = s.reader.read_group(chunks, 0, dest)
    assert (read.usable, read.skip, read.in_place) == (2, 0, dest is not None)
    assert s.known.get(h[3]) == 0
    s.reader.close()
    tier.close()


def test_a_miss_is_not_a_fault():
    s = Setup(HostStore(1 << 20))
    (read,) = s.reader.read_group([planned(chain(4))], 0)
    assert (read.payload, read.entry_blocks, read.usable) == (None, 0, 0)
    assert s.reader.tiers[0].stats.faults == 0


@pytest.mark.parametrize("in_place", [False, True])
def test_an_entry_gone_from_the_planned_tier_is_read_from_the_one_below(tmp_path, in_place):
    """The plan found the entry in the host tier; a write evicted it from there before the
    read (issue 45 item 6: 11 load rollbacks in a fault-free load run). The write-through
    disk tier still holds it: read from there, no miss, no fault."""
    host, disk = HostStore(1 << 20), DiskStore(tmp_path, 1 << 20)
    h = chain(8)
    for tier in (host, disk):
        put_entry(tier, h[0:4])
        put_entry(tier, h[4:8], first_block=4)
    s = Setup(host, disk)
    chunks = [planned(h[0:4]), planned(h[4:8], 4)]
    host.delete([FMT.entry_key(h[7], g) for g in (0, 1)])  # evicted since the plan

    def dest(i: int, entry_blocks: int) -> list[bytearray]:
        return [bytearray(entry_blocks * 32) for _ in range(2)]  # K, V of one layer

    for group in (0, 1):
        reads = s.reader.read_group(chunks, group, dest if in_place else None)
        assert [(r.usable, r.skip) for r in reads] == [(4, 0), (4, 0)]
    assert (host.stats.hits, host.stats.misses, disk.stats.hits) == (2, 2, 2)
    assert host.stats.faults == disk.stats.faults == 0
    s.reader.close()
    disk.close()


def test_lower_tier_hits_are_promoted_now_or_by_the_next_write(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path, 1 << 20)
    h = chain(8)
    put_entry(disk, h[0:4])
    put_entry(disk, h[4:8], first_block=4)
    s = Setup(host, disk)
    chunks = [planned(h[0:4], tiers=("disk", "disk")), planned(h[4:8], 4, tiers=("disk", "disk"))]
    s.reader.read_group(chunks[:1], 0)  # read into memory: promoted at once
    assert s.promoted == [(1, FMT.entry_key(h[3], 0))]
    assert s.known.get(h[3]) == 0

    def dest(i: int, entry_blocks: int) -> list[bytearray]:
        return [bytearray(entry_blocks * 32) for _ in range(2)]  # K, V of one layer

    (read,) = s.reader.read_group(chunks[1:], 0, dest)  # in place: nothing to promote now
    assert read.in_place and read.usable == 4
    assert len(s.promoted) == 1
    assert s.known.get(h[7]) == 1  # ... the request's write fills the tier above
    s.reader.close()
    disk.close()


def test_in_place_reads_of_an_entry_of_no_whole_size_are_faults(tmp_path):
    disk = DiskStore(tmp_path, 1 << 20)
    h = chain(4)
    key = FMT.entry_key(h[3], 0)
    disk.put([(key, b"x" * 100)])
    s = Setup(disk)
    (read,) = s.reader.read_group([planned(h, tiers=("disk", "disk"))], 0, lambda i, n: [])
    assert read.usable == 0 and (disk.stats.faults, disk.stats.hits) == (1, 0)
    assert disk.contains([key]) == [False]
    disk.close()


def test_reads_in_place_is_declared_by_the_disk_tier_only(tmp_path):
    disk = DiskStore(tmp_path, 1 << 20)
    redis_tier = RedisStore("redis://127.0.0.1:1/0")  # no network until used
    host = HostStore(1 << 20)
    assert isinstance(disk, ReadsInPlace)
    assert not isinstance(host, ReadsInPlace) and not isinstance(redis_tier, ReadsInPlace)
    assert all(isinstance(t, KVStore) for t in (disk, host, redis_tier))
    disk.close()
    redis_tier.close()


def test_get_into_contract(tmp_path):
    disk = DiskStore(tmp_path, 1 << 20)
    a, b, c = chain(3)
    disk.put([(a, b"0123456789"), (b, b"abc")])
    sizes: list[int] = []

    def split(num_bytes: int):
        sizes.append(num_bytes)
        return [bytearray(4), bytearray(num_bytes - 4)] if num_bytes >= 4 else None

    got = disk.get_into([a, b, c], [split, split, split])
    assert [bytes(x) for x in got[0]] == [b"0123", b"456789"]
    assert got[1] == []  # no buffers for that size: nothing read
    assert got[2] is None  # a miss: buffers_for not called
    assert sorted(sizes) == [3, 10]
    assert (disk.stats.hits, disk.stats.misses, disk.stats.bytes_read) == (2, 1, 10)
    assert disk.get([a]) == [b"0123456789"]  # plain get stays
    disk.close()
