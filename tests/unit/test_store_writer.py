"""The tiered store's writer on its own: typed jobs, the pending-bytes cap, flush, close."""

from __future__ import annotations

import logging
import threading
import time

from kvwise.core.kv_tiers import ChunkWrite
from kvwise.store import serde
from kvwise.store.host import HostStore
from kvwise.store.writer import Promote, WriteChunk, Writer
from tests.store_util import chain, entry_format, payload

FMT = entry_format()  # 2 layer groups, 128-byte blocks


def chunk_job(hashes: list[bytes], num_tiers: int | None = None, ttl_s=None) -> WriteChunk:
    return WriteChunk(ChunkWrite(0, tuple(hashes), num_tiers), payload(hashes), ttl_s)


class GatedHost(HostStore):
    """A host tier whose puts wait until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()

    def put(self, items, ttl_s=None, owner=None) -> bool:
        assert self.gate.wait(5)
        return super().put(items, ttl_s)


def test_a_chunk_is_packed_per_layer_group_and_written_to_its_tiers():
    top, bottom = HostStore(1 << 20), HostStore(1 << 20)
    writer = Writer([top, bottom], FMT, background=False)
    h = chain(4)
    assert writer.submit(chunk_job(h, num_tiers=1))
    keys = [FMT.entry_key(h[3], g) for g in (0, 1)]  # keyed by the entry's last block
    assert top.contains(keys) == [True, True] and bottom.contains(keys) == [False, False]
    # group g holds layer g: K then V of the 4 blocks, 32 bytes each, as the payload lays out
    for g, value in enumerate(top.get(keys)):
        entry = serde.unpack(FMT, keys[g], value)
        assert (entry.group, entry.block_hashes) == (g, h)
        assert bytes(entry.payload) == payload(h)[g * 256 : (g + 1) * 256]
    assert (writer.chunks_written, writer.writes_dropped, writer.pending_bytes) == (1, 0, 0)


def test_a_promotion_goes_to_the_tiers_above_only():
    tiers = [HostStore(1 << 20) for _ in range(3)]
    writer = Writer(tiers, FMT, background=False)
    key = chain(1)[0]
    assert writer.submit(Promote(2, key, b"entry"))
    assert [t.contains([key]) for t in tiers] == [[True], [True], [False]]
    assert writer.chunks_written == 0
    assert Promote(2, key, bytearray(10)).num_bytes == 10


def test_jobs_over_the_pending_cap_are_dropped_and_counted():
    host = GatedHost()
    writer = Writer([host], FMT, max_pending_bytes=600)
    h = chain(8)
    first, second = chunk_job(h[:4]), chunk_job(h[4:])
    assert first.num_bytes == 512
    assert writer.submit(first)
    assert writer.pending_bytes == 512
    assert not writer.submit(second)  # 1024 > 600 while the first waits
    assert writer.writes_dropped == 1
    host.gate.set()
    writer.flush()
    assert writer.pending_bytes == 0
    assert writer.submit(second)  # room again
    writer.close()
    assert writer.chunks_written == 2


def test_flush_waits_for_every_queued_job():
    host = GatedHost()
    writer = Writer([host], FMT)
    h = chain(12)
    for first in (0, 4, 8):
        assert writer.submit(chunk_job(h[first : first + 4]))
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (writer.flush(), flushed.set()))
    flusher.start()
    assert not flushed.wait(0.1)  # the puts are still held
    host.gate.set()
    assert flushed.wait(5)
    flusher.join()
    assert writer.chunks_written == 3 and writer.pending_bytes == 0
    writer.close()


def test_close_flushes_is_idempotent_and_then_drops():
    host = HostStore(1 << 20)
    writer = Writer([host], FMT)
    h = chain(4)
    writer.submit(chunk_job(h))
    writer.close()
    writer.close()
    assert host.contains([FMT.entry_key(h[3], 0)]) == [True]
    assert not writer.submit(chunk_job(chain(4, "b")))
    assert writer.writes_dropped == 1


def test_a_failing_job_does_not_stop_the_background_writer(caplog):
    class Broken(HostStore):
        def put(self, items, ttl_s=None, owner=None) -> None:
            raise RuntimeError("bug")

    good = HostStore(1 << 20)
    writer = Writer([good, Broken(1 << 20)], FMT)
    first, second = chain(1)[0], chain(1, "b")[0]
    assert writer.submit(Promote(2, first, b"x"))  # good, then the broken tier raises
    assert writer.submit(Promote(1, second, b"y"))  # good only: still written
    writer.flush()
    assert good.contains([first, second]) == [True, True]
    assert writer.pending_bytes == 0
    writer.close()
    # without a thread too, what a tier raises is a fault of that tier, never the caller's
    # error; the traceback is logged once, so that a bug still shows
    broken = Broken(1 << 20)
    foreground = Writer([broken], FMT, background=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvwise.store"):
        assert foreground.submit(Promote(1, chain(1)[0], b"x"))
        assert foreground.submit(Promote(1, chain(1, "c")[0], b"x"))
    assert broken.stats.faults == 2 and foreground.pending_bytes == 0
    (record,) = [r for r in caplog.records if "write error: RuntimeError: bug" in r.getMessage()]
    assert record.exc_info is not None  # with its traceback, once


def test_a_chunk_a_tier_fails_to_store_is_handed_back():
    fine, tiny = HostStore(1 << 20), HostStore(100)  # tiny holds no entry of this format
    lost = []
    writer = Writer([fine, tiny], FMT, background=False, on_lost=lost.append)
    job = chunk_job(chain(4))
    assert writer.submit(job)
    assert lost == [job.chunk]
    keys = [FMT.entry_key(job.chunk.key, g) for g in (0, 1)]
    assert fine.contains(keys) == [True, True]  # every tier stores what it can
    assert writer.submit(chunk_job(chain(4, "b"), num_tiers=1))  # the top tier alone: stored
    assert lost == [job.chunk]


def _written(host: HostStore, hashes: list[bytes]) -> bool:
    return host.contains([FMT.entry_key(hashes[-1], 0)]) == [True]


def _wait(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_writer_yields_to_a_busy_step_loop():
    """No job starts while the engine says it is busy, nor before it has been idle quiet_s;
    a job that has waited max_defer_s goes anyway, and a flush does not wait for quiet."""
    host = HostStore(1 << 20)
    writer = Writer([host], FMT, quiet_s=0.2, max_defer_s=30.0)
    writer.set_busy(True)
    a, b, c = chain(4, "a"), chain(4, "b"), chain(4, "c")
    writer.submit(chunk_job(a))
    time.sleep(0.3)
    assert not _written(host, a)  # busy: held
    writer.set_busy(False)
    idle = time.monotonic()
    assert _wait(lambda: _written(host, a))
    assert time.monotonic() - idle >= 0.19  # after quiet_s of idle
    writer.set_busy(True)
    writer.submit(chunk_job(b))
    time.sleep(0.1)
    assert not _written(host, b)
    assert writer.flush() and _written(host, b)  # a flush takes it at once, busy or not
    writer.max_defer_s = 0.3
    started = time.monotonic()
    writer.submit(chunk_job(c))
    assert _wait(lambda: _written(host, c))  # still busy: it goes once it has waited 0.3 s
    assert time.monotonic() - started >= 0.29
    writer.close()


def test_a_soon_job_is_not_held_for_a_busy_step_loop_nor_are_those_before_it():
    """A preempted request's blocks (``soon``) are written while the engine is busy, and so
    is a job queued before them; ``wait_soon`` returns once they are in the tier."""
    host = HostStore(1 << 20)
    writer = Writer([host], FMT, quiet_s=0.2, max_defer_s=30.0)
    writer.set_busy(True)
    a, b, c = chain(4, "a"), chain(4, "b"), chain(4, "c")
    writer.submit(chunk_job(a))
    time.sleep(0.2)
    assert not _written(host, a)  # busy: held
    writer.submit(WriteChunk(ChunkWrite(0, tuple(b)), payload(b), soon=True))
    assert writer.wait_soon() and _written(host, b) and _written(host, a)
    writer.submit(chunk_job(c))  # no soon job queued: held again
    time.sleep(0.2)
    assert not _written(host, c) and writer.wait_soon()
    writer.close()
    assert _written(host, c)


def test_wait_soon_gives_up_on_a_stuck_tier():
    host = GatedHost()
    writer = Writer([host], FMT)
    writer.stall_s = 0.3
    h = chain(4)
    writer.submit(WriteChunk(ChunkWrite(0, tuple(h)), payload(h), soon=True))
    started = time.monotonic()
    assert not writer.wait_soon()
    assert 0.25 <= time.monotonic() - started < 2
    host.gate.set()
    assert writer.wait_soon() and _written(host, h)
    writer.close()
