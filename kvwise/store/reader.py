"""Reads of planned loads, one layer group at a time, checked and matched. Pure Python.

The engine's loader thread calls ``read_group`` once per layer group while the step runs.

Contract:
- ``read_group`` reads the group's entry of every planned chunk (the entry that ends with
  the chunk's last block) from the tier the plan names for it (where that tier no longer
  holds it, e.g. the host tier evicted it for a write since the plan: from the tiers below,
  in order, which the write-through writer filled too), in a few parallel parts, and
  opens each entry (checks its header and tag and decrypts it: ``serde.open_parts`` in place
  where a ``ReadsInPlace`` tier read it straight into the caller's buffers, else
  ``serde.open_into`` those buffers, or ``serde.unpack`` without them). ``usable`` is how
  many of the chunk's blocks the entry holds, verified against the prompt's hashes; ``skip``
  how many of the entry's leading blocks come before the chunk. It never raises for a tier
  fault or a bad entry: a miss, a fault, a corrupt entry or one that starts after the
  chunk's first block gives ``usable`` 0. An exception in opening an entry (not a corrupt
  entry: a bug, a library that changed) is an error of the tier's reads, counted and logged
  by its health (``health.TierHealth``); an entry that opens is a success of its reads.
- A corrupt entry (fails its checks, or ends elsewhere than its key says) is a fault of its
  tier: counted and logged once per kind, deleted from the tier, and forgotten in the known
  map, so that it is written again. An entry that starts too late is no fault (another
  writer cut the sequence elsewhere): a miss.
- Promotion: a hit in layer group 0 is remembered as stored. A hit below the top tier is
  promoted to the tiers above: at once (``promote``) when its bytes were read into memory,
  else (read in place) by the request's own write when it leaves the pool, which the known
  map then sends to the tiers above this one only.
- Each tier's share of a call is timed into the cost model (``CostModel.observe_load``).
- Whatever a tier raises is a fault of that tier and a miss (``base.guarded``).
- Writes into ``dest``'s buffers happen only while ``dest.writing()`` is held (when ``dest``
  is a ``GatedDest``: the loader's gate, ``engine/kv_loader.py``), and ``read_group``
  returns (or raises) only once every part of it is done: after that, nothing it started
  writes into them.

NOTE: a tier that reads into memory (host, Redis) reads outside ``dest.writing()``: only
opening the entry into ``dest``'s buffers (AES-GCM, memory speed) is inside it, so a slow
tier never holds the gate. A ``ReadsInPlace`` tier (disk's ``preadv``) writes into them as it
reads, so its whole read is inside: joined, however long it takes. That is bounded by the
local disk; reading into memory first instead would cost the copy the in-place read saves.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from kvwise.core.kv_tiers import PlannedChunk
from kvwise.store import serde
from kvwise.store.base import FaultLog, KVStore, ReadsInPlace, guarded
from kvwise.store.costmodel import CostModel
from kvwise.store.planner import KnownChunks

_READ_PARTS = 4  # a tier's share of one read runs (and is checked) in this many parallel parts

# dest(i, entry_blocks): the payload buffers for planned chunk i's entry of that many blocks
# (None: the entry is too short to hold the chunk, or they are no longer wanted)
Dest = Callable[[int, int], list | None]


@runtime_checkable
class GatedDest(Protocol):
    """A ``Dest`` whose buffers may be written only while ``writing()`` is held (the loader's
    gate, ``engine/kv_loader.py``; the module docstring)."""

    def __call__(self, i: int, entry_blocks: int) -> list | None: ...

    def writing(self) -> AbstractContextManager[bool]:
        """Held while writing into the buffers; says whether they are still wanted."""
        ...


# promote(tier_index, key, entry): put an entry read from that tier into the tiers above it
PromoteFn = Callable[[int, bytes, bytes], object]


@dataclass(frozen=True)
class GroupRead:
    """One layer group of one planned chunk, as read: ``usable`` leading blocks of the chunk
    are verified and match the prompt; they are the entry's blocks from ``skip`` on."""

    payload: memoryview | None
    entry_blocks: int
    usable: int
    skip: int = 0
    in_place: bool = False  # opened straight into the device blocks ``dest`` gave


_MISS = GroupRead(None, 0, 0)


class _Got(NamedTuple):
    """One key as read: bytes read, the checked entry (or why it failed, or None: a miss),
    and the entry's bytes when they were read into memory (None: read in place)."""

    num_bytes: int
    entry: serde.Entry | serde.CorruptEntry | None
    value: bytes | bytearray | None


class Reader:
    """Reads for a ``TieredStore``; see the module docstring.

    Args:
        tiers: the tiers, top first.
        known: the planner's known map (hits remembered, corrupt entries forgotten).
        promote: queues a hit from a lower tier for the tiers above it.
    """

    def __init__(
        self,
        tiers: Sequence[KVStore],
        fmt: serde.EntryFormat,
        known: KnownChunks,
        cost: CostModel,
        promote: PromoteFn,
    ) -> None:
        self.tiers = list(tiers)
        self.fmt = fmt
        self.known = known
        self.cost = cost
        self._promote = promote
        self._faults = [FaultLog(t.name, t.stats) for t in self.tiers]  # by tier index
        self._pool = ThreadPoolExecutor(_READ_PARTS, thread_name_prefix="kvwise-kv-read")

    def read_group(
        self, chunks: Sequence[PlannedChunk], group: int, dest: Dest | None = None
    ) -> list[GroupRead]:
        """Read and check one layer group of each planned chunk.

        ``dest(i, entry_blocks)``, when given, returns the payload buffers for chunk ``i``
        (``worker.kv_cache.payload_views``): ``ReadsInPlace`` tiers read straight into them.
        A chunk's ``usable`` is 0 for a miss, a fault or a bad entry, and short of
        ``num_blocks`` when the entry stops matching the prompt.
        """
        keys = [self.fmt.entry_key(ch.key, group) for ch in chunks]
        out = [_MISS] * len(chunks)
        names = [t.name for t in self.tiers]
        # the tier each chunk is read from: the plan's, then, where that one no longer holds
        # its entry (evicted by a write since the plan), each tier below it in turn
        at = [names.index(ch.tiers[group]) if ch.tiers[group] in names else -1 for ch in chunks]
        for tier_index, tier in enumerate(self.tiers):
            idx = [i for i, t in enumerate(at) if t == tier_index]
            if not idx:
                continue
            t0 = time.perf_counter()
            in_place = dest is not None and isinstance(tier, ReadsInPlace)
            # NOTE: reads and decryption overlap across parts (file reads, socket reads and
            # AES-GCM all release the GIL)
            # a tier that reads in place gets one key per task, so that opening one entry
            # overlaps reading the next; others get a few batches (one round trip each)
            num_parts = len(idx) if in_place else min(_READ_PARTS, len(idx))
            parts = [idx[p::num_parts] for p in range(num_parts)]
            futures = [
                self._pool.submit(self._read, tier_index, keys, part, group, dest) for part in parts
            ]
            wait(futures)  # every part, even when one raised: none writes into dest later
            num_bytes = 0
            for part, future in zip(parts, futures):
                for i, read in zip(part, future.result()):
                    num_bytes += read.num_bytes
                    out[i] = self._check(tier_index, keys[i], read, chunks[i])
                    if read.entry is None and tier_index + 1 < len(names):
                        at[i] = tier_index + 1  # a miss here: try the tier below
            self.cost.observe_load(tier.name, len(idx), num_bytes, time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self._pool.shutdown()

    def _read(self, tier_index: int, keys, part: list[int], group: int, dest) -> list[_Got]:
        """Get and open the entries ``keys[i]`` for ``i`` in ``part`` (one batch)."""
        tier, faults = self.tiers[tier_index], self._faults[tier_index]
        misses = [None] * len(part)
        writing = dest.writing if isinstance(dest, GatedDest) else contextlib.nullcontext
        if dest is not None and isinstance(tier, ReadsInPlace):

            def buffers_for(i: int):
                def make(num_bytes: int) -> list | None:
                    num_blocks = serde.entry_blocks_from_size(self.fmt, group, num_bytes)
                    if num_blocks is None:
                        return None
                    head = bytearray(self.fmt.head_bytes(num_blocks))
                    return [
                        head,
                        *self._into(dest, i, group, num_blocks),
                        bytearray(serde.TAG_SIZE),
                    ]

                return make

            with writing():  # the read itself lands in dest's buffers
                got = guarded(
                    faults,
                    "get_into",
                    tier.get_into,
                    [keys[i] for i in part],
                    [buffers_for(i) for i in part],
                    miss=misses,
                )
                return [self._open_parts(keys[i], b, faults) for i, b in zip(part, got)]
        values = guarded(faults, "get", tier.get, [keys[i] for i in part], miss=misses)
        with writing():  # opened into dest's buffers
            return [self._open(keys[i], v, group, i, dest, faults) for i, v in zip(part, values)]

    def _open(
        self, key: bytes, value, group: int, i: int, dest: Dest | None, faults: FaultLog
    ) -> _Got:
        """Open an entry read into memory: into ``dest``'s buffers when given. An exception
        other than a corrupt entry's is an error of the tier's reads (a miss)."""
        if value is None:
            return _Got(0, None, None)
        try:
            if dest is None:
                return _Got(len(value), serde.unpack(self.fmt, key, value), value)
            num_blocks = serde.entry_blocks_from_size(self.fmt, group, len(value))
            if num_blocks is None:
                raise serde.CorruptEntry("entry size")
            buffers = [bytearray(32 * num_blocks), *self._into(dest, i, group, num_blocks)]
            return _Got(len(value), serde.open_into(self.fmt, key, value, buffers), value)
        except serde.CorruptEntry as e:
            return _Got(len(value), e, value)
        except Exception as exc:  # a bug, or a library that changed under us: loud, a miss
            faults.exception("open", exc)
            return _Got(len(value), None, None)

    def _into(self, dest: Dest, i: int, group: int, num_blocks: int) -> list:
        """``dest``'s buffers for an entry of ``num_blocks``, or a scratch buffer when it
        is too short for the chunk (opened all the same, then found to start too late)."""
        buffers = dest(i, num_blocks)
        if buffers is None:
            return [bytearray(num_blocks * self.fmt.group_block_bytes(group))]
        return buffers

    def _open_parts(self, key: bytes, buffers: list | None, faults: FaultLog) -> _Got:
        if buffers is None:
            return _Got(0, None, None)
        if not buffers:  # the tier's size for it is no whole entry: nothing was read
            return _Got(0, serde.CorruptEntry("entry size"), None)
        num_bytes = sum(memoryview(b).nbytes for b in buffers)
        try:
            return _Got(num_bytes, serde.open_parts(self.fmt, key, buffers), None)
        except serde.CorruptEntry as e:
            return _Got(num_bytes, e, None)
        except Exception as exc:  # as in ``_open``
            faults.exception("open", exc)
            return _Got(num_bytes, None, None)

    def _check(self, tier_index: int, key: bytes, read: _Got, chunk: PlannedChunk) -> GroupRead:
        """Match a read entry against the prompt; faults, deletion and promotion."""
        entry, value, tier = read.entry, read.value, self.tiers[tier_index]
        if entry is None:
            return _MISS
        end = chunk.first_block + chunk.num_blocks
        if isinstance(entry, serde.CorruptEntry) or entry.first_block + entry.num_blocks != end:
            reason = entry if isinstance(entry, serde.CorruptEntry) else "misplaced entry"
            self._faults[tier_index].corrupt(reason)
            guarded(self._faults[tier_index], "delete", tier.delete, [key], miss=None)
            self.known.forget(chunk.key)
            return _MISS
        self._faults[tier_index].success("read")  # read and opened: the tier reads fine
        skip = chunk.first_block - entry.first_block
        if skip < 0:  # it starts after the chunk's first block: no use to this prompt
            return _MISS
        usable = 0
        while usable < chunk.num_blocks and (
            entry.block_hashes[skip + usable] == chunk.block_hashes[usable]
        ):
            usable += 1
        if entry.group == 0:
            # a hit below the top tier is promoted: at once when we hold its bytes, else by
            # the request's own write when it finishes (to the tiers above this one only)
            promote_later = tier_index if value is None else 0
            self.known.remember(chunk.key, promote_later)
        if tier_index and value is not None:
            self._promote(tier_index, key, value)
        in_place = entry.payload is None
        return GroupRead(entry.payload, entry.num_blocks, usable, skip, in_place)
