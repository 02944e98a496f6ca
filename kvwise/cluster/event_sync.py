"""Keeping a router's index in step with a replica's cache over an unreliable channel.

A replica's ``EventPublisher`` turns the engine's KV events into numbered msgpack batches
(``kv_events_codec``) and keeps the last ``ring`` of them; ``since(seq)`` hands out the batches
after ``seq``, or None when some were already dropped from the ring. The router's
``IndexSync`` applies batches to its ``PrefixIndex`` strictly in order: a batch that is not
the next one (a gap: a batch lost, a replica restarted) is refused, and the router asks for a
``snapshot`` instead — every hash the replica's pool holds, as of a batch number — which
replaces what the index held for it. ``EventHub`` sits between them (replicas push, routers
pull): the Ray deployment wraps it in an actor. With its load a replica names the requests it
admitted since it last published (that load counts them): a router stops counting the work it
sent there itself once the hub says so (``routing.RecentWork``). Pure Python: the transport is
the caller's.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from kvwise.cluster.kv_events_codec import decode_batch, encode_batch
from kvwise.cluster.routing import PrefixIndex
from kvwise.core.hashing import BlockHash
from kvwise.core.kv_events import KVEvent

ACKED = 4096  # request ids the hub remembers a replica acknowledged


class EventPublisher:
    """Replica side. ``take_events``: the engine's ``take_kv_events``; ``held``: every hash
    its device pool holds now (both called between engine steps)."""

    def __init__(
        self,
        take_events: Callable[[], list[KVEvent]],
        held: Callable[[], Iterable[BlockHash]],
        ring: int = 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ring < 1:
            raise ValueError(f"ring: expected at least 1 batch, got {ring}")
        self._take = take_events
        self._held = held
        self._clock = clock
        self.seq = 0  # the number of the last batch
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring)

    def poll(self) -> tuple[int, bytes] | None:
        """Number and encode the events since the last poll; None when there were none."""
        events = self._take()
        if not events:
            return None
        self.seq += 1
        batch = (self.seq, encode_batch(events, self._clock()))
        self._ring.append(batch)
        return batch

    def since(self, seq: int) -> list[tuple[int, bytes]] | None:
        """The batches after ``seq``; None when the oldest of them left the ring (or ``seq`` is
        ahead of this publisher: it restarted): take a ``snapshot``."""
        if seq > self.seq or (seq < self.seq and (not self._ring or self._ring[0][0] > seq + 1)):
            return None
        return [b for b in self._ring if b[0] > seq]

    def snapshot(self) -> tuple[int, list[BlockHash]]:
        """Every hash held now, as of batch ``seq`` (pending events are numbered first)."""
        self.poll()
        return self.seq, list(self._held())


class IndexSync:
    """Router side: each replica's batches applied in order to ``index``."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.cursor: dict[str, int] = {}  # replica -> the last batch applied
        self.gaps = 0  # batches refused (a snapshot was needed)
        self.need_snapshot: set[str] = set()  # replicas to ask a snapshot of (sync_from_hub)

    def apply(self, replica: str, batches: Iterable[tuple[int, bytes]]) -> bool:
        """Apply the next batches; False (and nothing more applied) at a gap."""
        for seq, data in batches:
            last = self.cursor.get(replica, 0)  # a replica not seen yet: from its first batch
            if seq <= last:
                continue  # already applied
            if seq != last + 1:
                self.gaps += 1
                return False
            self.index.apply(replica, decode_batch(data)[1])
            self.cursor[replica] = seq
        return True

    def apply_snapshot(self, replica: str, seq: int, hashes: Iterable[BlockHash]) -> None:
        self.index.replace(replica, hashes)
        self.cursor[replica] = seq

    def drop(self, replica: str) -> None:
        """A replica gone: forget it (a restarted one comes back through a snapshot)."""
        self.index.drop(replica)
        self.cursor.pop(replica, None)
        self.need_snapshot.discard(replica)


class EventHub:
    """Between replicas and routers (a Ray actor wraps one): replicas ``publish`` their
    numbered batches and load; routers ``pull`` what is new past their cursors. A router that
    finds a gap asks for a snapshot (``want_snapshot``); the replica learns it from the
    return value of its next ``publish`` and sends one (``publish_snapshot``), which the hub
    hands to routers in place of batches."""

    def __init__(self, ring: int = 1024) -> None:
        if ring < 1:
            raise ValueError(f"ring: expected at least 1 batch, got {ring}")
        self.ring = ring
        self._batches: dict[str, deque[tuple[int, bytes]]] = {}
        self._loads: dict[str, tuple[int, int]] = {}
        self._snapshots: dict[str, tuple[int, list[BlockHash]]] = {}
        self._wanted: set[str] = set()
        # the requests each replica admitted before its latest load, the last ACKED of them
        self._acked: dict[str, OrderedDict[str, None]] = {}

    def publish(
        self,
        replica: str,
        batches: Iterable[tuple[int, bytes]],
        load: tuple[int, int],
        acked: Iterable[str] = (),
    ) -> bool:
        """Store a replica's new batches, its ``(queued, running)`` tokens and the ids of the
        requests it admitted since its last publish (which that load counts). True: send a
        snapshot."""
        ring = self._batches.setdefault(replica, deque(maxlen=self.ring))
        ring.extend(batches)
        self._loads[replica] = load
        seen = self._acked.setdefault(replica, OrderedDict())
        for request_id in acked:
            seen[request_id] = None
        while len(seen) > ACKED:
            seen.popitem(last=False)
        return replica in self._wanted

    def publish_snapshot(self, replica: str, seq: int, hashes: Iterable[BlockHash]) -> None:
        self._snapshots[replica] = (seq, list(hashes))
        self._wanted.discard(replica)

    def want_snapshot(self, replica: str) -> None:
        self._wanted.add(replica)

    def drop(self, replica: str) -> None:
        """A replica gone (its actor died): nothing of it is handed out any more."""
        for table in (self._batches, self._loads, self._snapshots, self._acked):
            table.pop(replica, None)
        self._wanted.discard(replica)

    def pull(
        self, cursors: dict[str, int], pending: dict[str, list[str]] | None = None
    ) -> dict[str, dict]:
        """For each replica: ``load``, and ``batches`` past the router's cursor, or a
        ``snapshot`` ``(seq, hashes)`` when one newer than the cursor is there; and ``acked``:
        which of the router's ``pending`` requests to it the replica has acknowledged."""
        out: dict[str, dict] = {}
        pending = pending or {}
        for replica, load in self._loads.items():
            cursor = cursors.get(replica, 0)
            seen = self._acked.get(replica, {})
            item: dict = {
                "load": load,
                "acked": [r for r in pending.get(replica, ()) if r in seen],
            }
            snapshot = self._snapshots.get(replica)
            if snapshot is not None and snapshot[0] > cursor:
                item["snapshot"] = snapshot
                cursor = snapshot[0]
            item["batches"] = [b for b in self._batches.get(replica, ()) if b[0] > cursor]
            out[replica] = item
        return out


def sync_from_hub(sync: IndexSync, hub_reply: dict[str, dict]) -> dict[str, tuple[int, int]]:
    """Apply a ``pull`` reply to a router's ``IndexSync``; return the loads. Replicas whose
    batches do not follow on are listed in ``sync.need_snapshot`` for the caller to ask the
    hub for (``want_snapshot``)."""
    loads = {}
    for replica, item in hub_reply.items():
        loads[replica] = tuple(item["load"])
        if "snapshot" in item:
            seq, hashes = item["snapshot"]
            sync.apply_snapshot(replica, seq, hashes)
        if not sync.apply(replica, item["batches"]):
            sync.need_snapshot.add(replica)
        else:
            sync.need_snapshot.discard(replica)
    return loads
