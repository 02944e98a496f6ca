"""Host and disk KV tiers: round trips, exact eviction order, keep times, restart, faults."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

import kvwise.store.disk as disk_mod
import kvwise.store.disk_files as disk_files
from kvwise.core.kv_spec import KVSpec
from kvwise.store import serde
from kvwise.store.base import KVStore
from kvwise.store.disk import DiskStore
from kvwise.store.host import HostStore
from tests.store_util import FakeClock, key, value

K = {name: key(i) for i, name in enumerate("abcdefgh")}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["host", "disk"])
def make_store(request, tmp_path, clock):
    stores = []

    def make(capacity_bytes: int):
        if request.param == "host":
            store = HostStore(capacity_bytes, clock=clock)
        else:
            store = DiskStore(tmp_path / "kv", capacity_bytes, clock=clock)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def names(store, keys_in_order) -> str:
    by_key = {v: k for k, v in K.items()}
    return "".join(by_key[k] for k in keys_in_order)


def tmp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


# --- both tiers ---------------------------------------------------------------------------


def test_round_trip(make_store):
    store = make_store(1000)
    assert isinstance(store, KVStore)
    store.put([(K["a"], value(0)), (K["b"], bytearray(value(1, 50)))])
    assert store.contains([K["a"], K["b"], K["c"]]) == [True, True, False]
    assert store.get([K["b"], K["c"], K["a"]]) == [value(1, 50), None, value(0)]
    assert (store.stats.hits, store.stats.misses, store.stats.loads) == (2, 1, 1)
    assert store.stats.bytes_read == store.stats.bytes_written == 150
    assert (store.stats.num_entries, store.stats.num_bytes) == (2, 150)

    store.put([(K["a"], value(9, 70))])  # replaces
    assert store.get([K["a"]]) == [value(9, 70)]
    assert store.stats.num_bytes == 120

    store.delete([K["a"], K["c"]])
    assert store.contains([K["a"], K["b"]]) == [False, True]
    assert store.get([K["a"]]) == [None]
    assert (store.stats.num_entries, store.stats.num_bytes) == (1, 50)
    assert store.get([]) == [] and store.contains([]) == []
    assert store.stats.faults == 0


def test_bad_keys_raise(make_store):
    store = make_store(1000)
    for bad in (b"x" * 31, "a" * 32, None):
        with pytest.raises(ValueError, match="key"):
            store.get([bad])
        with pytest.raises(ValueError, match="key"):
            store.put([(bad, b"v")])
    with pytest.raises(ValueError, match="value"):
        store.put([(K["a"], "not bytes")])


def test_lru_eviction_exact_order(make_store):
    store = make_store(300)
    store.put([(K["a"], value(0)), (K["b"], value(1)), (K["c"], value(2))])
    assert names(store, store.eviction_order()) == "abc"
    store.get([K["a"]])  # refreshes a
    assert names(store, store.eviction_order()) == "bca"

    store.put([(K["d"], value(3))])
    assert names(store, store.eviction_order()) == "cad"
    assert store.contains([K["b"]]) == [False]
    store.put([(K["e"], value(4, 150))])  # needs two victims
    assert names(store, store.eviction_order()) == "de"
    assert store.stats.evictions == 3
    assert store.stats.num_bytes == 250
    store.put([(K["d"], value(3))])  # re-put refreshes
    assert names(store, store.eviction_order()) == "ed"


def test_kept_entries_outlive_plain_ones(make_store):
    store = make_store(300)
    store.put([(K["a"], value(0))], ttl_s=100)
    store.put([(K["b"], value(1)), (K["c"], value(2))])
    store.put([(K["d"], value(3))])
    store.put([(K["e"], value(4))])
    assert names(store, store.eviction_order()) == "dea"  # plain ones first, then kept
    assert store.get([K["a"]]) == [value(0)]
    # with only kept entries left, the least recently used kept one goes
    store.put([(K["f"], value(5)), (K["g"], value(6))], ttl_s=100)
    assert names(store, store.eviction_order()) == "afg"
    store.get([K["a"]])
    store.put([(K["h"], value(7))], ttl_s=100)
    assert names(store, store.eviction_order()) == "gah"


def test_expired_kept_entries_become_evictable(make_store, clock):
    store = make_store(300)
    store.put([(K["a"], value(0))], ttl_s=10)
    store.put([(K["b"], value(1)), (K["c"], value(2))])
    clock.t += 5
    store.put([(K["d"], value(3))])  # a still kept: b goes
    assert names(store, store.eviction_order()) == "cda"
    clock.t += 6
    store.put([(K["e"], value(4))])  # a expired: it is the oldest plain entry now
    assert names(store, store.eviction_order()) == "cde"


def test_reput_without_ttl_keeps_the_keep(make_store, clock):
    store = make_store(200)
    store.put([(K["a"], value(0))], ttl_s=10)
    store.put([(K["a"], value(0))])
    store.put([(K["b"], value(1)), (K["c"], value(2))])
    assert names(store, store.eviction_order()) == "ca"


def test_oversize_entry_not_stored(make_store):
    store = make_store(100)
    store.put([(K["a"], value(0, 60))])
    store.put([(K["b"], value(1, 101))])
    assert store.contains([K["a"], K["b"]]) == [True, False]
    assert store.stats.evictions == 0
    store.put([(K["c"], value(2, 100))])  # exactly the budget fits
    assert store.contains([K["a"], K["c"]]) == [False, True]


def test_close_is_idempotent_and_then_everything_misses(make_store):
    store = make_store(1000)
    store.put([(K["a"], value(0))])
    store.close()
    store.close()
    assert store.get([K["a"]]) == [None]
    assert store.contains([K["a"]]) == [False]
    store.put([(K["b"], value(1))])
    store.delete([K["a"]])
    assert store.stats.faults == 0


# --- disk only ----------------------------------------------------------------------------


def test_disk_layout(tmp_path):
    store = DiskStore(tmp_path, 1000)
    store.put([(K["a"], value(0))])
    hex_key = K["a"].hex()
    path = tmp_path / hex_key[:2] / f"{hex_key}.kv"
    assert store.file_path(K["a"]) == str(path)
    assert path.read_bytes() == value(0)
    assert tmp_files(tmp_path) == []
    store.close()


def test_disk_restart_rebuilds_index_order_and_keep(tmp_path, clock):
    store = DiskStore(tmp_path, 1000, clock=clock)
    clock.t = 100
    store.put([(K["a"], value(0))])
    clock.t = 101
    store.put([(K["b"], value(1, 40))], ttl_s=1000)  # kept until 1101
    clock.t = 102
    store.put([(K["c"], value(2))])
    clock.t = 103
    store.get([K["a"]])
    assert names(store, store.eviction_order()) == "cab"
    store.close()

    clock.t = 200
    store = DiskStore(tmp_path, 1000, clock=clock)
    assert names(store, store.eviction_order()) == "cab"
    assert (store.stats.num_entries, store.stats.num_bytes) == (3, 240)
    assert store.contains([K["a"], K["b"], K["c"]]) == [True, True, True]
    assert store.get([K["b"]]) == [value(1, 40)]
    clock.t = 201
    assert store.get([K["a"]]) == [value(0)]
    store.close()

    clock.t = 2000  # b's keep has run out; the reads above made b (200) and a (201) newest
    store = DiskStore(tmp_path, 1000, clock=clock)
    assert names(store, store.eviction_order()) == "cba"
    store.close()


def test_disk_start_deletes_temporaries_and_trims(tmp_path, clock):
    store = DiskStore(tmp_path, 1000, clock=clock)
    for i, name in enumerate("abcde"):
        clock.t += 1
        store.put([(K[name], value(i))])
    store.close()
    sub = tmp_path / K["a"].hex()[:2]
    (sub / f".{K['a'].hex()}.123.abcd1234.tmp").write_bytes(b"half")
    (tmp_path / "README").write_text("not an entry")

    store = DiskStore(tmp_path, 250, clock=clock)
    assert tmp_files(tmp_path) == []
    assert (tmp_path / "README").exists()
    assert names(store, store.eviction_order()) == "de"
    assert store.stats.evictions == 3
    assert sorted(p.name[:64] for p in tmp_path.rglob("*.kv")) == sorted(
        [K["d"].hex(), K["e"].hex()]
    )
    store.close()


def test_disk_truncated_file_is_returned_and_serde_rejects_it(tmp_path):
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype="float32")
    fmt = serde.EntryFormat(spec, "m")
    key = serde.entry_key(K["a"], 0)
    entry = serde.pack(fmt, [K["a"]], 0, 0, bytes(fmt.block_bytes))
    store = DiskStore(tmp_path, 1000)
    store.put([(key, entry)])
    assert serde.unpack(fmt, key, store.get([key])[0]).num_blocks == 1
    os.truncate(store.file_path(key), len(entry) - 5)

    [got] = store.get([key])
    assert bytes(got) == entry[:-5]
    with pytest.raises(serde.CorruptEntry):
        serde.unpack(fmt, key, got)
    assert store.stats.faults == 0
    store.delete([key])  # what the tiered layer does with a corrupt entry
    assert not os.path.exists(store.file_path(key))
    store.close()


def test_disk_file_deleted_behind_its_back_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, 1000)
    store.put([(K["a"], value(0)), (K["b"], value(1))])
    os.unlink(store.file_path(K["a"]))
    assert store.get([K["a"], K["b"]]) == [None, value(1)]
    assert (store.stats.faults, store.stats.misses) == (0, 1)
    assert store.contains([K["a"]]) == [False]
    assert (store.stats.num_entries, store.stats.num_bytes) == (1, 100)
    store.close()


def test_disk_replace_enospc_is_a_fault(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1000)
    store.put([(K["a"], value(0))])

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    store.put([(K["b"], value(1))])
    monkeypatch.undo()
    assert store.stats.faults == 1
    assert tmp_files(tmp_path) == []
    assert store.contains([K["a"], K["b"]]) == [True, False]
    store.put([(K["b"], value(1))])
    assert store.get([K["b"]]) == [value(1)]
    store.close()


def test_disk_write_errors_are_faults(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1000)
    real_open = open

    class FullFile:
        def __init__(self, f) -> None:
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path, mode="r", *args, **kwargs):
        if mode == "rb":
            raise OSError(errno.EIO, "Input/output error")
        f = real_open(path, mode, *args, **kwargs)
        return FullFile(f) if mode == "xb" else f

    store.put([(K["a"], value(0))])
    monkeypatch.setattr(disk_mod, "open", fake_open, raising=False)  # writes
    monkeypatch.setattr(disk_files, "open", fake_open, raising=False)  # reads
    store.put([(K["b"], value(1)), (K["c"], value(2))])
    assert store.stats.faults == 2
    assert tmp_files(tmp_path) == []
    assert store.contains([K["a"], K["b"], K["c"]]) == [True, False, False]

    assert store.get([K["a"]]) == [None]  # EIO: a fault, and the entry stays indexed
    assert (store.stats.faults, store.stats.misses) == (3, 0)
    monkeypatch.undo()
    assert store.get([K["a"]]) == [value(0)]
    store.close()


def test_disk_concurrent_put_get(tmp_path):
    store = DiskStore(tmp_path, 2000, num_io_threads=4)
    num_keys = 40
    errors: list[str] = []

    def worker(seed: int) -> None:
        for step in range(150):
            i = (seed * 7 + step * 13) % num_keys
            batch = [key(i), key((i + 1) % num_keys), key((i + 5) % num_keys)]
            if step % 3 == 0:
                store.put([(key(i), value(i, 60 + i))], ttl_s=5 if i % 4 == 0 else None)
            elif step % 3 == 1:
                for j, got in zip((i, i + 1, i + 5), store.get(batch)):
                    if got is not None and got != value(j % num_keys, 60 + j % num_keys):
                        errors.append(f"wrong value for key {j}")
            elif step % 15 == 2:
                store.delete([key(i)])
            else:
                store.contains(batch)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert store.stats.faults == 0
    on_disk = {bytes.fromhex(p.name[:64]): p.stat().st_size for p in tmp_path.rglob("*.kv")}
    indexed = set(store.eviction_order())
    assert set(on_disk) == indexed
    assert store.stats.num_bytes == sum(on_disk.values()) <= 2000
    assert store.stats.num_entries == len(on_disk)
    assert tmp_files(tmp_path) == []
    store.close()


def test_disk_drop_page_cache(tmp_path):
    store = DiskStore(tmp_path, 1000)
    store.put([(K["a"], value(0)), (K["b"], value(1))])
    assert store.drop_page_cache() == 2
    assert store.drop_page_cache([K["a"], K["c"]]) == 1
    assert store.get([K["a"], K["b"]]) == [value(0), value(1)]
    store.close()
