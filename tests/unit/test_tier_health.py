"""A tier that fails is loud: its errors counted by operation, logged once per kind with the
traceback (then rate-limited), a breaker after consecutive errors, a reason for /health, and
the start-up self-test. Pure Python (host and disk tiers, no model)."""

from __future__ import annotations

import errno
import logging

import pytest

from kvwise.store import disk_files, serde
from kvwise.store.base import FaultLog, guarded
from kvwise.store.disk import DiskStore
from kvwise.store.health import TierHealth
from kvwise.store.host import HostStore
from kvwise.store.stats import TierStats
from kvwise.store.tiered import TieredStore
from tests.store_util import FMT, FakeClock, chain, load, make_store, write_all


def _errors(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and text in r.getMessage()]


def test_consecutive_errors_of_one_operation_open_the_breaker_and_a_success_closes_it(caplog):
    clock = FakeClock()
    health = TierHealth(threshold=3, cooldown_s=10, clock=clock)
    for _ in range(2):
        health.error("disk", "get_into", "read EIO")
    health.success("disk", "put")  # writes work: the reads' run goes on
    assert health.allows() and "read: read EIO" in health.reason()
    health.error("disk", "open", "ValueError: data and buf must not overlap")
    assert not health.allows() and health.reason().startswith("breaker open (3 consecutive")
    clock.t += 10.5  # half-open: calls go through again
    assert health.allows() and "breaker" not in health.reason()
    health.error("disk", "get", "read EIO")  # still failing: open again at once
    assert not health.allows()
    clock.t += 10.5
    health.success("disk", "get_into")
    assert health.allows() and not health.is_open()
    clock.t += 61  # the last error is a minute old: no longer degraded
    assert health.reason() == ""
    assert any("breaker closed" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="op"):
        health.error("disk", "scan", "x")


def test_each_distinct_error_is_logged_once_with_its_traceback_then_rate_limited(caplog):
    clock = FakeClock()
    stats = TierStats()
    faults = FaultLog("disk", stats)
    stats.health = TierHealth(threshold=100, log_every_s=60, clock=clock)
    faults.health = stats.health
    caplog.set_level(logging.WARNING, "kvwise.store")
    try:
        raise OSError(errno.EIO, "Input/output error")
    except OSError as exc:
        eio = exc
    for _ in range(5):
        faults.error("read", "read EIO", "/some/path", eio)
    faults.exception("put", RuntimeError("bug"))
    first = _errors(caplog, "read error: read EIO")
    assert len(first) == 1 and first[0].exc_info is not None  # once, with its traceback
    assert len(_errors(caplog, "write error: RuntimeError: bug")) == 1
    clock.t += 61
    faults.error("read", "read EIO", "/some/path", eio)
    again = _errors(caplog, "read error: read EIO")
    assert len(again) == 2 and again[1].exc_info is None
    assert "and 4 more like it" in again[1].getMessage()
    assert (stats.read_errors, stats.write_errors, stats.faults) == (6, 1, 7)


def test_guarded_skips_a_tier_whose_breaker_is_open():
    calls = []

    def broken(keys):
        calls.append(keys)
        raise ConnectionError("down")

    stats = TierStats()
    faults = FaultLog("redis", stats)
    for _ in range(5):  # the default threshold
        assert guarded(faults, "contains", broken, [b"k"], miss=[False]) == [False]
    assert stats.lookup_errors == 5 and faults.health.is_open()
    assert guarded(faults, "contains", broken, [b"k"], miss=[False]) == [False]
    assert len(calls) == 5  # not called while open
    snap = stats.snapshot()
    assert snap.breaker_open == 1 and "ConnectionError: down" in snap.degraded
    assert snap.health is None and stats.health is not None  # a snapshot is plain data


def _in_memory(plan):
    """A ``dest`` of scratch buffers (the disk tier reads in place into them)."""
    return lambda i, num_blocks: [bytearray(num_blocks * FMT.group_block_bytes(0))]


def test_every_disk_read_raising_is_counted_logged_once_and_trips_the_breaker(
    tmp_path, monkeypatch, caplog
):
    store = make_store(DiskStore(str(tmp_path), 1 << 24))
    prompts = [chain(4, f"p{i}") for i in range(8)]
    for hashes in prompts:
        write_all(store, hashes)
    assert load(store, prompts[0], 0, 4, 17, _in_memory)[1] == 4  # the control: it loads

    def eio(fd, buffers):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_files, "_preadv_all", eio)
    caplog.set_level(logging.WARNING, "kvwise.store")
    planned = []
    for hashes in prompts:
        plan, loaded, _ = load(store, hashes, 0, 4, 17, _in_memory)
        assert loaded == 0  # a miss: the prompt is recomputed
        planned.append(plan is not None)
    # each load reads 2 layer groups: the 5th read (the threshold) opens the breaker in the
    # third load, which then skips the tier: nothing is planned
    assert planned == [True] * 3 + [False] * 5
    stats = store.stats().tiers["disk"]
    assert stats.read_errors == 5 and stats.breaker_open == 1
    assert "breaker open" in stats.degraded and "read EIO" in stats.degraded
    (logged,) = _errors(caplog, "read error: read EIO")
    assert logged.exc_info is not None
    assert len(_errors(caplog, "breaker open after 5 consecutive read errors")) == 1
    store.close()


def test_an_exception_in_opening_an_entry_is_a_read_error_not_a_crash(tmp_path, monkeypatch):
    """What cryptography 51 did to in-place reads: ``open_parts`` raised a ValueError."""
    store = make_store(DiskStore(str(tmp_path), 1 << 24))
    hashes = chain(4)
    write_all(store, hashes)

    def refuses(*args):
        raise ValueError("data and buf must not overlap")

    monkeypatch.setattr(serde, "open_parts", refuses)
    assert load(store, hashes, 0, 4, 17, _in_memory)[1] == 0
    stats = store.stats().tiers["disk"]
    assert stats.read_errors == 2  # one per layer group
    assert "data and buf must not overlap" in stats.degraded
    monkeypatch.undo()
    assert load(store, hashes, 0, 4, 17, _in_memory)[1] == 4  # still there, and it loads
    store.close()


def test_the_self_test_passes_on_working_tiers_and_names_a_failing_one(tmp_path, monkeypatch):
    host, disk = HostStore(1 << 20), DiskStore(str(tmp_path), 1 << 24)
    store = TieredStore([host, disk], FMT, background=False)
    checks = store.self_test()
    assert [(c.tier, c.error) for c in checks] == [("host", None), ("disk", None)]
    assert disk.stats.num_entries == 0 and host.stats.num_entries == 0  # deleted again

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_files.os, "replace", no_space)
    host_ok, disk_failed = store.self_test()
    assert host_ok.error is None
    assert disk_failed.error == "write: the entry was not stored"
    assert "disk FAILED (write" in str(disk_failed)
    stats = store.stats().tiers["disk"]
    assert stats.write_errors == 1 and "write ENOSPC" in stats.degraded
    store.close()
