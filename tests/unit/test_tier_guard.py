"""Whatever a tier does wrong stays a fault of that tier, for any tier (``store.base.guarded``
and the deadlines): a tier that raises anything is a miss for lookups, loads and writes,
counted, its traceback logged once; a tier stuck past its deadline costs a load at most the
loader's deadline (the load is abandoned and recomputed, token-identical; a read landing in
the device blocks is waited for, never abandoned) and a flush at most the writer's stall
bound. The tiers are fakes on the host tier."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvwise.engine import kv_loader
from kvwise.store import registry
from kvwise.store.host import HostStore
from kvwise.store.tiered import TieredStore
from kvwise.store.writer import Writer
from tests.fakes import fake_engine, run_all
from tests.store_util import chain, entry_format, payload
from tests.tiers_util import evict_device

FMT = entry_format()  # 2 layer groups
OPS = ("contains", "get", "put", "delete")


class Faulty(HostStore):
    """A host tier whose ops in ``failing`` raise what no tier should (a bug, a client
    library's surprise); ``stuck`` ones block until ``release`` is set."""

    def __init__(self, name: str = "faulty", deadline_s: float | None = None) -> None:
        super().__init__(1 << 20)
        self.name = name
        self.deadline_s = deadline_s
        self.failing: set[str] = set()
        self.stuck: set[str] = set()
        self.release = threading.Event()
        self.entered = threading.Event()  # a stuck call is waiting

    def _check(self, op: str) -> None:
        if op in self.stuck:
            self.entered.set()
            self.release.wait(30)
        if op in self.failing:
            raise ValueError(f"{op} went wrong")

    def contains(self, keys):
        self._check("contains")
        return super().contains(keys)

    def get(self, keys):
        self._check("get")
        return super().get(keys)

    def put(self, items, ttl_s=None, owner=None):
        self._check("put")
        return super().put(items, ttl_s)

    def delete(self, keys):
        self._check("delete")
        return super().delete(keys)


class InPlace(Faulty):
    """``Faulty`` that reads in place (``ReadsInPlace``), as disk does; ``stuck`` "get_into"
    blocks *after* taking the caller's buffers, as a slow ``preadv`` into them would."""

    def get_into(self, keys, buffers_for):
        values = HostStore.get(self, keys)
        out = []
        for value, make in zip(values, buffers_for):
            buffers = None if value is None else make(len(value))
            if buffers is not None and "get_into" in self.stuck:
                self.entered.set()
                self.release.wait(30)
            if buffers:
                view, at = memoryview(value), 0
                for b in buffers:
                    n = memoryview(b).nbytes
                    memoryview(b).cast("B")[:] = view[at : at + n]
                    at += n
            out.append(buffers if value is not None else None)
        return out


def store_over(*tiers) -> TieredStore:
    return TieredStore(list(tiers), FMT, chunk_blocks=4, min_tokens=4, policy="always",
                       background=False)  # fmt: skip


def write_all(store: TieredStore, hashes) -> None:
    for w in store.plan_writes(hashes, len(hashes)):
        store.write(w, payload(list(w.block_hashes)))


def test_a_tier_that_raises_is_a_miss_for_lookups_loads_and_writes(caplog):
    faulty, host = Faulty(), HostStore(1 << 20)
    store = store_over(faulty, host)
    h = chain(8)
    write_all(store, h)  # both tiers hold it
    faulty.failing = set(OPS)
    with caplog.at_level(logging.WARNING, "kvwise.store"):
        # lookups: the faulty tier answers "none", the host tier below finds every entry
        plan = store.plan_load("r", h, 0, 8, 33)
        assert [ch.tiers for ch in plan.chunks] == [("host", "host")] * 2
        assert faulty.stats.faults == 2  # group 0's ends asked first, then the others
        # loads: planned from the faulty tier, they miss there (faults) and are read from
        # the tier below, which holds them too
        faulty.failing = {"get", "put", "delete"}
        plan = store.plan_load("r2", h, 0, 8, 33)
        assert plan.chunks[0].tiers == ("faulty", "faulty")
        reads = store.read_group(plan.chunks, 0)
        assert [r.usable for r in reads] == [4, 4] and host.stats.hits == 2
        # 2 parts' gets fail, and so do the 2 promotions of the host's hits back up to it
        assert faulty.stats.faults == 6 and faulty.stats.read_errors == 2
        # writes: the faulty tier stores nothing, the chunk is handed back to be rewritten
        h2 = chain(8, "b")
        write_all(store, h2)
        assert host.contains([FMT.entry_key(h2[-1], 0)]) == [True]
        assert store.plan_writes(h2, 8) != []  # not known as stored: written again
        assert faulty.stats.faults == 8  # one put per chunk
    # each kind logged once, with its traceback: a bug in a tier shows
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split(": ValueError")[0] for r in errors] == [
        "kv tier faulty: lookup error",
        "kv tier faulty: read error",
        "kv tier faulty: write error",
    ]
    assert [r.getMessage().rsplit("(", 1)[1] for r in errors] == [
        "in contains)",
        "in get)",
        "in put)",
    ]
    assert all(r.exc_info is not None for r in errors)
    store.close()


def test_a_stuck_flush_gives_up_after_the_writers_stall_bound():
    stuck = Faulty("stuck", deadline_s=0.1)
    stuck.stuck = {"put"}
    writer = Writer([stuck], FMT)
    assert writer.stall_s == pytest.approx(1.1)  # its tiers' deadlines + a margin
    assert writer.submit(WriteChunk_for(chain(4)))
    assert writer.submit(WriteChunk_for(chain(4, "b")))
    start = time.monotonic()
    assert writer.flush() is False  # no job finished within the bound
    assert time.monotonic() - start < 2 * writer.stall_s
    start = time.monotonic()
    writer.close()  # flushes once more (in vain), then leaves the stuck thread behind
    assert time.monotonic() - start < 1.5 * writer.stall_s
    stuck.release.set()


def WriteChunk_for(hashes):  # noqa: N802 - reads as the job it makes
    from kvwise.core.kv_tiers import ChunkWrite
    from kvwise.store.writer import WriteChunk

    return WriteChunk(ChunkWrite(0, tuple(hashes)), payload(hashes))


# ---- the loader's deadline, in a whole engine ----------------------------------------------

P_TOKENS = 8
LONG = "The same long prefix every time, " * 3  # 99 bytes: 24 full blocks of 4


@pytest.fixture
def tier_kind():
    """Register a tier kind for the engines of one test: ``tier_kind(tier)``."""
    names = []

    def register(tier):
        registry.register_tier(tier.name, lambda config: tier)
        names.append(tier.name)
        return tier

    yield register
    for name in names:
        registry.unregister_tier(name)


def engine_over(**kwargs):
    from kvwise.types import SamplingParams

    params = SamplingParams(max_tokens=P_TOKENS, temperature=0, ignore_eos=True)
    engine = fake_engine(kv_store_min_tokens=8, kv_chunk_blocks=4, kv_load_policy="always",
                         kv_layer_groups=2, **kwargs)  # fmt: skip
    return engine, params


@pytest.mark.parametrize("tier_cls", [Faulty, InPlace], ids=["into-memory", "in-place"])
def test_a_load_stuck_past_its_deadline_is_abandoned_and_recomputed(tier_kind, tier_cls):
    reference_engine, params = engine_over()
    reference = run_all(reference_engine, [LONG], params)[0].token_ids
    tier = tier_kind(tier_cls("stuck", deadline_s=0.1))
    engine, _ = engine_over()
    assert run_all(engine, [LONG], params)[0].token_ids == reference
    evict_device(engine)
    tier.stuck = {"get", "get_into"}  # the next load blocks, past the tier's own deadline
    deadline_s = 2 * 0.1 + 1.0  # what kv_loader derives: two groups' reads + a margin
    in_place = tier_cls is InPlace
    if in_place:  # the read holds the device blocks: let it finish well after the deadline
        threading.Timer(deadline_s + 0.5, tier.release.set).start()
    start = time.monotonic()
    out = run_all(engine, [LONG], params)[0]
    seconds = time.monotonic() - start
    assert tier.entered.is_set()
    assert out.token_ids == reference and out.num_loaded_tokens == 0
    assert engine.stats().num_load_rollbacks == 1
    if in_place:  # joined: the step waited for the read into its blocks, then recomputed
        assert deadline_s + 0.5 <= seconds < deadline_s + 1.5
    else:  # abandoned: the read is left behind, reading into memory of its own
        assert deadline_s <= seconds < deadline_s + 0.5
    tier.release.set()
    time.sleep(0.05)  # the abandoned read returns now, into nothing
    tier.stuck = set()
    # the blocks it would have written are reused: every answer still the reference's
    evict_device(engine)
    again = run_all(engine, [LONG, LONG + "!"], params)
    assert again[0].token_ids == reference and again[0].num_loaded_tokens > 0
    assert again[1].token_ids == run_all(reference_engine, [LONG + "!"], params)[0].token_ids
    engine.check_integrity()
    engine.close()


def test_the_loaders_deadline_comes_from_the_tiers_it_reads():
    class Store:
        tiers = [Faulty("a", deadline_s=0.25), HostStore(1)]

    class Load:
        def __init__(self, tiers):
            self.chunk = type("Chunk", (), {"tiers": tiers})()

    assert kv_loader.wait_deadline(Store, [Load(("a", "a"))]) == pytest.approx(2 * 0.25 + 1.0)
    # a tier with no deadline of its own (host RAM, disk): the store's default for it
    assert kv_loader.wait_deadline(Store, [Load(("a", "host"))]) == pytest.approx(
        2 * (0.25 + 5.0) + 1.0
    )
