"""The tiered store's reader on its own: checks and matching, corrupt entries as faults,
promotion, and reading in place (``ReadsInPlace``: disk is one, host and Redis are not)."""

from __future__ import annotations

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


def put_chunk(tier: KVStore, hashes: list[bytes], first_block: int = 0) -> None:
    """Store a chunk as the writer would: one entry per layer group."""
    data = payload(hashes)
    size = len(hashes) * FMT.group_block_bytes(0)
    tier.put([
        (serde.entry_key(hashes[0], g),
         serde.pack(FMT, hashes, first_block, g, data[g * size : (g + 1) * size]))
        for g in (0, 1)
    ])  # fmt: skip


def planned(hashes: list[bytes], first_block: int = 0, skip: int = 0, tiers=("host", "host")):
    return PlannedChunk(first_block, skip, len(hashes) - skip, tuple(hashes), tiers)


class Setup:
    def __init__(self, *tiers: KVStore) -> None:
        self.known = KnownChunks()
        self.promoted: list[tuple[int, bytes]] = []
        self.reader = Reader(list(tiers), FMT, self.known, CostModel(),
                             lambda i, key, value: self.promoted.append((i, key)))  # fmt: skip


def test_reads_are_checked_and_matched_against_the_prompt():
    host = HostStore(1 << 20)
    h = chain(8)
    put_chunk(host, h[0:4])
    put_chunk(host, h[4:8], first_block=4)
    s = Setup(host)
    other = h[:6] + chain(2, "b")  # the second chunk matches two blocks only
    reads = s.reader.read_group([planned(other[0:4], skip=1), planned(other[4:8], 4)], 0)
    assert [(r.entry_blocks, r.usable, r.in_place) for r in reads] == [(4, 4, False), (4, 2, False)]
    assert bytes(reads[0].payload) == payload(h[0:4])[:256]
    # group 0 hits are remembered as stored: the entry's own last block
    assert s.known.get(h[0]) == (h[3], 0) and s.known.get(h[4]) == (h[7], 0)
    assert s.promoted == []  # a top-tier hit is not promoted
    s.reader.close()


def test_a_corrupt_entry_is_a_fault_deleted_and_forgotten():
    host = HostStore(1 << 20)
    h = chain(4)
    put_chunk(host, h)
    key = serde.entry_key(h[0], 1)
    (value,) = host.get([key])
    host.put([(key, value[:-1] + bytes([value[-1] ^ 1]))])  # a flipped payload bit
    s = Setup(host)
    chunk = planned(h)
    assert s.reader.read_group([chunk], 0)[0].usable == 4
    assert s.known.get(h[0]) == (h[3], 0)
    hits = host.stats.hits
    (read,) = s.reader.read_group([chunk], 1)
    assert (read.payload, read.usable) == (None, 0)
    assert host.stats.faults == 1 and host.stats.hits == hits  # a fault, not also a hit
    assert host.contains([key]) == [False]  # deleted
    assert s.known.get(h[0]) == (None, 0)  # forgotten: the chunk gets written again
    s.reader.close()


def test_an_entry_of_another_chunk_is_a_fault():
    host = HostStore(1 << 20)
    h = chain(4)
    put_chunk(host, h, first_block=8)  # stored as blocks 8.. of some sequence
    s = Setup(host)
    assert s.reader.read_group([planned(h)], 0)[0].usable == 0
    assert host.stats.faults == 1 and host.contains([serde.entry_key(h[0], 0)]) == [False]


def test_a_miss_is_not_a_fault():
    s = Setup(HostStore(1 << 20))
    (read,) = s.reader.read_group([planned(chain(4))], 0)
    assert (read.payload, read.entry_blocks, read.usable) == (None, 0, 0)
    assert s.reader.tiers[0].stats.faults == 0


def test_lower_tier_hits_are_promoted_now_or_by_the_next_write(tmp_path):
    host, disk = HostStore(1 << 20), DiskStore(tmp_path, 1 << 20)
    h = chain(8)
    put_chunk(disk, h[0:4])
    put_chunk(disk, h[4:8], first_block=4)
    s = Setup(host, disk)
    chunks = [planned(h[0:4], tiers=("disk", "disk")), planned(h[4:8], 4, tiers=("disk", "disk"))]
    s.reader.read_group(chunks[:1], 0)  # read into memory: promoted at once
    assert s.promoted == [(1, serde.entry_key(h[0], 0))]
    assert s.known.get(h[0]) == (h[3], 0)

    def dest(i: int, entry_blocks: int) -> list[bytearray]:
        return [bytearray(entry_blocks * 32) for _ in range(2)]  # K, V of one layer

    (read,) = s.reader.read_group(chunks[1:], 0, dest)  # in place: nothing to promote now
    assert read.in_place and read.usable == 4
    assert len(s.promoted) == 1
    assert s.known.get(h[4]) == (h[7], 1)  # ... the request's write fills the tier above
    s.reader.close()
    disk.close()


def test_in_place_reads_of_an_entry_of_no_whole_size_are_faults(tmp_path):
    disk = DiskStore(tmp_path, 1 << 20)
    h = chain(4)
    disk.put([(serde.entry_key(h[0], 0), b"x" * 100)])
    s = Setup(disk)
    (read,) = s.reader.read_group([planned(h, tiers=("disk", "disk"))], 0, lambda i, n: [])
    assert read.usable == 0 and (disk.stats.faults, disk.stats.hits) == (1, 0)
    assert disk.contains([serde.entry_key(h[0], 0)]) == [False]
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
