"""The contract every KV tier implements: a handful of batched methods and a stats record.

- Keys are 32-byte block-chain hashes (they already carry model, KV layout, tenant and salt,
  so isolation holds in every tier). Values are opaque bytes: a versioned header and the
  payload in one piece (``serde.pack``); a tier never interprets them.
- Every method takes a batch and never raises for a tier fault (I/O error, timeout, full
  disk, server down): ``get`` answers ``None`` for that key, ``contains`` ``False``, ``put``
  drops the entry. The fault is counted in ``stats.faults`` and logged once per kind. Only
  programming errors (wrong types) raise. The store calls every tier through ``guarded``
  all the same: whatever a tier raises (a client library's surprise, a bug) is a fault of
  that tier and a miss, never an error of the engine.
- Deadlines: a tier whose calls can block on something outside this machine (Redis) sets
  ``deadline_s`` and returns from every call within it, whole (not per socket read), serving
  what it did not get as a miss. A tier without one (host RAM, local disk) is assumed to
  finish within ``DEFAULT_DEADLINE_S``; ``call_deadline`` says which applies. The loader's
  waits and the writer's flush are bounded by these (``engine/kv_loader.py``, ``writer.py``).
- ``get`` of a key refreshes its recency (LRU); ``put`` of an existing key replaces it.
- ``ttl_s`` on ``put``: keep the entry at least that long where the tier can (Redis: TTL of
  at least that; disk and host: evicted after every entry without one, until it expires).
- Thread safety: a tier may be called from the engine thread and the background writer at
  once; implementations lock what they share.
- Optional abilities are small protocols of their own, declared here and checked with
  ``isinstance`` (never by probing an attribute's name): ``ReadsInPlace`` (``get_into``:
  straight into the caller's buffers), ``HasDeadline`` (``deadline_s``), ``HasLoadPrior``
  (``load_prior``: the cost model's start), ``SharedTier`` (``shared``: other engines use
  it, so keys need the shared secret), ``KeepsLocalSecret`` (``local_secret()``: a secret
  kept beside the entries) and ``ReportsEvictions`` (``on_evict``: a tier that evicts on its
  own says what; the ``EvictionReports`` mixin implements it) and ``ExtendsKeeps``
  (``extend_keeps``: a stored entry's keep refreshed without rewriting it). A tier without
  one is served the default the protocol names.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvwise.store.health import TierHealth, op_class
from kvwise.store.stats import TierStats

logger = logging.getLogger("kvwise.store")

T = TypeVar("T")

# how long a call of a tier that declares no ``deadline_s`` (RAM, a local disk) may take before
# the loader and the writer stop waiting for it
DEFAULT_DEADLINE_S = 5.0


@runtime_checkable
class KVStore(Protocol):
    """One tier. ``name`` says which kind (e.g. "host"); it keys stats, metrics and plans."""

    name: str
    stats: TierStats

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present (a hint: an entry may vanish before ``get``)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The entries, ``None`` where missing or faulty."""
        ...

    def put(
        self,
        items: Sequence[tuple[bytes, bytes]],
        ttl_s: float | None = None,
        owner: str | None = None,
    ) -> bool:
        """Store ``(key, entry)`` pairs; may evict others to stay under the budget. Returns
        True when every pair was stored, False when any was not (a fault, an entry over the
        budget, a closed tier): the caller may write it again later. ``owner``: the tenant
        whose ``ttl_s`` it is, for a tier that caps what one tenant may keep (host, disk).
        A ``bytearray`` entry is handed over: the tier may keep it as it is, so the caller
        must not change it afterwards."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drop keys (absent keys are ignored); used for corrupt entries."""
        ...

    def close(self) -> None:
        """Release files, connections and threads. Idempotent."""
        ...

    def describe(self) -> str:
        """One line for the start-up log, e.g. "host 2.0 GiB"."""
        ...


# given an entry's size in bytes, the buffers to read it into (None: no such entry size)
BuffersFor = Callable[[int], list | None]


@runtime_checkable
class ReadsInPlace(KVStore, Protocol):
    """A tier that reads entries straight into buffers the caller provides (disk: ``preadv``
    into the device pool), so a load needs no intermediate copy and the caller checks the
    bytes where they landed."""

    def get_into(self, keys: Sequence[bytes], buffers_for: Sequence[BuffersFor]) -> list:
        """Read each present key's entry into the buffers ``buffers_for[i]`` gives.

        ``buffers_for[i](num_bytes)`` is called at most once, possibly on another thread,
        with the stored entry's size, and only for a key that is present. It returns a list
        of writable buffers whose sizes add up to ``num_bytes`` (filled in order: the first
        bytes of the entry go into the first buffer), or ``None`` when no entry can have
        that size.

        Returns, per key: that list of buffers, filled (an entry that shrank while read
        leaves the rest as it was, for the caller's checksum to catch); ``None`` for a
        miss or a fault; ``[]`` when ``buffers_for`` returned ``None`` (nothing was read; a
        hit in the stats, with 0 bytes read).
        """
        ...


# ---- optional abilities (see the module docstring) ----------------------------------------


@runtime_checkable
class ExtendsKeeps(Protocol):
    """A tier that can refresh the keep of entries it already holds (a cache breakpoint's
    or a retention's TTL, refreshed by each hit): without it an entry keeps the TTL it was
    written with."""

    def extend_keeps(self, keys: Sequence[bytes], ttl_s: float, owner: str | None = None) -> None:
        """Keep each present key at least ``ttl_s`` from now (never shortened; on
        ``owner``'s account, within its cap, as ``put`` keeps); absent keys are ignored."""
        ...


@runtime_checkable
class HasDeadline(Protocol):
    """A tier whose calls can block on something outside this machine (Redis): each returns
    within ``deadline_s`` seconds (None or 0: ``DEFAULT_DEADLINE_S`` applies)."""

    deadline_s: float | None


@runtime_checkable
class HasLoadPrior(Protocol):
    """A tier that states where the cost model's fit of its read time starts (without one:
    ``costmodel.DEFAULT_TIER_PRIOR``, a slow tier until measured)."""

    load_prior: tuple[float, float, float]  # λ s, μ s per entry, s per GB


@runtime_checkable
class SharedTier(Protocol):
    """A tier other engines read and write too (Redis) when ``shared``: entry keys must then
    be HMACs under a secret they all share (``store.factory.store_secret``)."""

    shared: bool


@runtime_checkable
class KeepsLocalSecret(Protocol):
    """A tier that keeps a store secret of its own beside its entries (disk), used when none
    is configured and no tier is shared."""

    def local_secret(self) -> bytes:
        """The secret (made on first use). Raises OSError when it can be neither read nor
        made."""
        ...


@runtime_checkable
class ReportsEvictions(Protocol):
    """A tier that evicts on its own (host, disk): each victim's key goes to ``on_evict``,
    set by whoever tracks what the tier holds (``store.tier_events``; None: nobody does)."""

    on_evict: Callable[[bytes], None] | None


class EvictionReports(ReportsEvictions):
    """Mixin implementing ``ReportsEvictions``: a tier calls ``_evicted(key)`` per victim."""

    on_evict: Callable[[bytes], None] | None = None

    def _evicted(self, key: bytes) -> None:
        if self.on_evict is not None:
            self.on_evict(key)


def call_deadline(tier: KVStore) -> float:
    """Seconds one call of ``tier`` may take: its own ``deadline_s`` (which it enforces),
    else ``DEFAULT_DEADLINE_S``."""
    return (isinstance(tier, HasDeadline) and tier.deadline_s) or DEFAULT_DEADLINE_S


# NOTE: one tier's faults are counted by several FaultLogs (its own, the store's guards), on
# several threads: one lock for all of them keeps ``stats.faults`` exact
_COUNT_LOCK = threading.Lock()


class FaultLog:
    """Counts one tier's faults into its ``stats``: errors (an exception or a timeout in an
    operation: ``error``, ``exception``) go to the tier's ``health.TierHealth``, which logs
    them and trips the tier's breaker; corrupt entries are logged once per kind."""

    def __init__(self, tier: str, stats: TierStats) -> None:
        self.tier = tier
        self.stats = stats
        with _COUNT_LOCK:  # the tier's one TierHealth, whichever FaultLog comes first
            if stats.health is None:
                stats.health = TierHealth()
        self.health: TierHealth = stats.health
        self._seen: set[str] = set()

    def corrupt(self, detail: object = "") -> None:
        """An entry the tier returned (and counted as a hit) failed its checks: it is a
        fault, not a hit, and no error of the tier (its bytes were read)."""
        with _COUNT_LOCK:
            self.stats.hits -= 1
            self.stats.faults += 1
            first = str(detail) not in self._seen
            self._seen.add(str(detail))
        log = logger.warning if first else logger.debug
        log("kv tier %s: corrupt entry %s (served as a miss)", self.tier, detail)

    def error(
        self, op: str, kind: str, detail: object = "", exc: BaseException | None = None
    ) -> None:
        """One error of the tier operation ``op`` (``health.op_class`` names them), of
        ``kind`` (``TierHealth.error``): counted by its class (``stats.<class>_errors``) and
        reported to the tier's health."""
        field = f"{op_class(op)}_errors"
        with _COUNT_LOCK:
            self.stats.faults += 1
            setattr(self.stats, field, getattr(self.stats, field) + 1)
        self.health.error(self.tier, op, kind, detail, exc)

    def exception(self, op: str, exc: BaseException) -> None:
        """``op`` (e.g. "contains") raised ``exc``."""
        self.error(op, f"{type(exc).__name__}: {exc}", f"in {op}", exc)

    def success(self, op: str) -> None:
        """``op`` worked (ends its run of errors: ``TierHealth.success``)."""
        self.health.success(self.tier, op)


def guarded(faults: FaultLog, op: str, call: Callable[..., T], *args: Any, miss: T) -> T:
    """``call(*args)``, or ``miss`` when it raises anything at all: whatever a tier raises
    is a fault of that tier (``faults``), served as a miss, and never reaches the engine.

    NOTE: this is the one fault boundary between the store and its tiers (the planner, the
    reader and the writer call every tier through it), so a new tier needs nothing of its
    own for it. ``Exception`` only: an interrupt still interrupts.

    It is also the breaker: while the tier's is open (``health.TierHealth``), ``miss`` at once,
    without calling it. A call that raised nothing and counted no error of its own is a
    success of ``op``, except a read's (``get``, ``get_into``): that succeeds once what it
    read opens (``reader.Reader``).
    """
    health = faults.health
    if not health.allows():
        return miss
    errors_before = error_count(faults.stats)
    try:
        out = call(*args)
    except Exception as exc:
        faults.exception(op, exc)
        return miss
    if op_class(op) != "read" and error_count(faults.stats) == errors_before:
        faults.success(op)
    return out


def error_count(stats: TierStats) -> int:
    """A tier's errors so far, every operation's."""
    return stats.read_errors + stats.write_errors + stats.lookup_errors + stats.delete_errors
