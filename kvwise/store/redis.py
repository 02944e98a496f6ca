"""The Redis tier: entries shared between engines through a Redis server.

One Redis key per entry, ``prefix + key.hex()``, whose value is the entry bytes (header and
payload together, so there is never a payload without its header). Every entry gets a TTL of
at least the store's ``ttl_s``; Redis expires and evicts entries itself.

Contract (on top of ``base.KVStore``):
- One round trip per call: ``get`` is one MGET, ``contains``, ``put`` and
  ``extend_keeps`` one non-transactional pipeline (EXISTS, SET ... EX, EXPIRE ... GT: a
  TTL is only ever lengthened; Redis 7 or later), ``delete`` one DEL.
- A deadline for the whole call: ``timeout_s`` (``deadline_s``) bounds each call from start
  to end, connect, handshake and every reply byte included (redis-py's socket timeout bounds
  each socket read only: a server that answers a byte at a time would never trip it). The
  client's work runs on this store's I/O threads and the caller waits for it at most that
  long; past it the call is a fault (a miss), the node's connections are closed (which ends
  the read stuck on them) and the node is down.
- Anything a call raises is a fault: counted, logged once per kind, served as a miss (a
  Redis error, a socket error, a reply redis-py cannot make sense of and raises some other
  exception for, a reply of the wrong shape). After a connection-level fault (server down,
  deadline passed, refused login, a reply that makes no sense) the node's connections are
  closed and the store is *down* for ``retry_after_s``: calls answer misses at once, with no
  network and no stats, so a dead or confused server costs one deadline, not one per
  request. An error reply (e.g. OOM on SET) is a fault but not an outage.
- Coming back (half-open): once a node's window has passed, the next call to it is sent in
  the background, as a probe, and answered as a miss at once; only when a probe succeeds is
  the node up again. So a server that stays broken costs a caller (the engine's step loop,
  which looks entries up while it schedules) one deadline in all, never one per window.
- Nothing touches the network before the first call: an unreachable server at start-up is a
  fault on first use, not an exception.
- Stats: ``evictions`` stays 0 and the ``num_entries``/``num_bytes`` gauges stay 0: Redis
  expires and evicts on its own and the server is shared, so this process cannot know what
  it holds (``bytes_written`` says what this process sent).
- Thread safety: redis-py's client draws connections from a thread-safe pool; this store
  locks only its own counters and outage state.

NOTE: a call abandoned at its deadline may still be running on an I/O thread until its
connection is closed under it; it only ever reads into memory of its own, and its outcome is
dropped (never counted, never returned), so nothing of it reaches a caller late.

Redis Cluster (``redis+cluster://`` / ``rediss+cluster://``, any node as the seed): entry keys
are HMACs, so they spread over every hash slot. Each call groups its keys by the node that
serves their slot and sends each node one non-transactional pipeline of single-key commands
(GET, EXISTS, SET, DEL: no multi-key command has to stay within one slot), every node at
once, all within the call's deadline. A node's fault
and outage window are its own: its entries are misses while the other nodes keep serving.
The cluster's slot map is read on the first call, not at start-up.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvwise.store.base import FaultLog
from kvwise.store.index import check_key, check_value
from kvwise.store.stats import TierStats

if TYPE_CHECKING:
    from kvwise.config import StoreConfig

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_SKIPPED = object()  # the call did not reach the server (closed, down, or a fault)
_IO_THREADS = 16  # calls in flight at once (the engine, loader, writer threads; per node)
# what redis-py raises for the faults it knows (anything else: a surprise, logged with its
# traceback once)
_CLIENT_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


class RedisStore:
    """Redis tier. ``RedisStore("redis://:password@127.0.0.1:6379/0", ttl_s=3600)``.

    Args:
        url: ``redis://[[user]:password@]host:port/db``, ``rediss://...`` or ``unix://...``.
        ttl_s: minimum TTL of every entry, in seconds.
        timeout_s: the deadline of each call, whole (connect, handshake, every reply).
        retry_after_s: how long the store stays down after a connection-level fault.
        prefix: namespace of this store's Redis keys.
        clock: monotonic seconds, for the outage window (injectable for tests).
    """

    name = "redis"
    shared = True  # other engines read and write it: entry keys need the shared secret
    load_prior = (5e-4, 1e-4, 2.0)  # the cost model's start: λ s, μ s per entry, s per GB

    def __init__(
        self,
        url: str,
        ttl_s: float = 3600,
        timeout_s: float = 0.5,
        retry_after_s: float = 5.0,
        prefix: str = "kvwise:kv:",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        scheme = urlsplit(url).scheme if isinstance(url, str) else type(url).__name__
        if scheme not in _SCHEMES:
            # NOTE: never echo the URL itself, it may hold a password
            raise ValueError(
                "kv_redis_url: expected redis://[:password@]host:port/db (or rediss://, "
                f"unix://, redis+cluster://), got scheme {scheme!r}"
            )
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: expected > 0 seconds, got {ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s: expected >= 0 seconds, got {retry_after_s}")
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s  # the deadline of a call (base.KVStore's deadline_s)
        self.retry_after_s = retry_after_s
        self.prefix = prefix
        self.stats = TierStats()
        self._clock = clock
        self._faults = FaultLog(self.name, self.stats)
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}  # per node ("" for a single server)
        self._probing: set[str] = set()  # down nodes with a probe in flight
        self._closed = False
        self.cluster = scheme.endswith("+cluster")
        options = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # redis-py retries 3 times by default
        )
        self._client: Any = None
        self._cluster_url = url.replace("+cluster", "", 1) if self.cluster else None
        self._cluster_options = options
        self._io = concurrent.futures.ThreadPoolExecutor(
            _IO_THREADS, thread_name_prefix="kvwise-redis"
        )
        try:
            if not self.cluster:
                self._client = redis.Redis.from_url(url, health_check_interval=0, **options)
            else:
                redis.connection.parse_url(self._cluster_url)  # a bad URL fails now, not later
        except ValueError as exc:
            raise ValueError(f"kv_redis_url: {exc}") from None

    @property
    def deadline_s(self) -> float:
        """``base.KVStore``'s deadline: every call returns within it."""
        return self.timeout_s

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        found = self._per_node("contains", names, lambda pipe, name: pipe.exists(name))
        return [n is not _SKIPPED and bool(n) for n in found]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        names = self._names(keys)
        if not names:
            return []
        start = time.perf_counter()
        if self.cluster:
            values = self._per_node("get", names, lambda pipe, name: pipe.get(name))
        else:
            values = self._call("get", lambda: _replies(self._client.mget(names), names))
            if values is _SKIPPED:
                values = [_SKIPPED] * len(names)
        # NOTE: a value that is not bytes (a confused server) is no entry: a miss
        values = [v if v is _SKIPPED or isinstance(v, bytes) else None for v in values]
        served = [v for v in values if v is not _SKIPPED]
        values = [None if v is _SKIPPED else v for v in values]
        if not served:
            return values
        num_hits = sum(v is not None for v in served)
        with self._lock:
            self.stats.hits += num_hits
            self.stats.misses += len(served) - num_hits
            self.stats.bytes_read += sum(len(v) for v in values if v is not None)
            if num_hits:
                self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
        return values

    def put(
        self,
        items: Sequence[tuple[bytes, bytes]],
        ttl_s: float | None = None,
        owner: str | None = None,
    ) -> bool:
        # NOTE: ``owner`` is not capped here: Redis evicts by its own maxmemory policy, and a
        # longer TTL does not keep an entry ahead of others' under allkeys-lru (the policy
        # to run a shared KV tier with); it only lasts longer
        checked = [(self.prefix + check_key(k).hex(), v, check_value(v)) for k, v in items]
        if not checked:
            return True
        ex = max(1, math.ceil(max(self.ttl_s, ttl_s or 0.0)))
        values = {name: value for name, value, _ in checked}

        def add(pipe, name: str) -> None:
            value = values[name]
            pipe.set(name, value if isinstance(value, (bytes, bytearray)) else bytes(value), ex=ex)

        done = self._per_node("put", [name for name, _, _ in checked], add)
        stored = [c for c, d in zip(checked, done, strict=True) if d is not _SKIPPED]
        with self._lock:
            self.stats.bytes_written += sum(num_bytes for _, _, num_bytes in stored)
        # False: a fault (server or node down, timeout) or the breaker open: not all stored
        return len(stored) == len(checked)

    def extend_keeps(self, keys: Sequence[bytes], ttl_s: float, owner: str | None = None) -> None:
        # NOTE: ``owner`` is not capped, as in ``put``
        names = self._names(keys)
        if ttl_s > 0:
            ex = max(1, math.ceil(max(self.ttl_s, ttl_s)))
            self._per_node("extend", names, lambda pipe, name: pipe.expire(name, ex, gt=True))

    def delete(self, keys: Sequence[bytes]) -> None:
        names = self._names(keys)
        if names and not self.cluster:
            self._call("delete", lambda: self._client.delete(*names))
        elif names:  # one key a DEL: a multi-key DEL must stay within one slot
            self._per_node("delete", names, lambda pipe, name: pipe.delete(name))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._client is None:
            return
        try:
            self._client.close()
            if not self.cluster:
                self._client.connection_pool.disconnect()
        except Exception:  # closing is best effort: the calls in flight end either way
            pass

    def describe(self) -> str:
        # NOTE: never the URL: it may hold a password
        return "redis"

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.prefix + check_key(k).hex() for k in keys]

    def _per_node(self, op: str, names: list[str], add: Callable[[Any, str], Any]) -> list[Any]:
        """One pipeline a node of ``add(pipe, name)`` commands, every node at once; the
        results in ``names``' order, ``_SKIPPED`` where the node was down or faulted."""
        results: list[Any] = [_SKIPPED] * len(names)
        if not names:
            return results
        if self._client is None:  # a cluster's first call: its slot map, over the network
            groups = self._call(op, lambda: self._groups(names))
        else:  # no network: the server, or the slot map read already
            groups = self._call_here(op, lambda: self._groups(names))
        if groups is _SKIPPED:
            return results

        def run(client, indices: list[int]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for i in indices:
                add(pipe, names[i])
            return _replies(pipe.execute(), indices)

        calls = [
            (node, lambda c=client, ix=indices: run(c, ix)) for node, client, indices in groups
        ]
        for (_, _, indices), out in zip(groups, self._calls(op, calls), strict=True):
            if out is not _SKIPPED:
                for i, value in zip(indices, out, strict=True):
                    results[i] = value
        return results

    def _groups(self, names: list[str]) -> list[tuple[str, Any, list[int]]]:
        """``(node, client, indices)`` for each node serving some of ``names``."""
        if not self.cluster:
            return [("", self._client, list(range(len(names))))]
        if self._client is None:  # the slot map is read on the first call
            self._client = redis.cluster.RedisCluster.from_url(
                self._cluster_url, require_full_coverage=False, **self._cluster_options
            )
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            node = self._client.get_node_from_key(name)
            entry = by_node.setdefault(node.name, (node, []))
            entry[1].append(i)
        return [
            (key, self._client.get_redis_connection(node), indices)
            for key, (node, indices) in by_node.items()
        ]

    def _call(self, op: str, run: Callable[[], Any], node: str = "") -> Any:
        """``run()``'s result, or ``_SKIPPED`` if closed, ``node`` down, or it faulted
        (raised, or passed the deadline)."""
        return self._calls(op, [(node, run)])[0]

    def _calls(self, op: str, calls: list[tuple[str, Callable[[], Any]]]) -> list[Any]:
        """Each ``(node, run)``'s result (``_SKIPPED``: closed, node down, or it faulted),
        all run at once on the I/O threads and waited for within one deadline."""
        out: list[Any] = [_SKIPPED] * len(calls)
        futures: dict[int, concurrent.futures.Future] = {}
        with self._lock:
            now = self._clock()
            todo, probes = [], []
            for i, (node, _) in enumerate(calls):
                if self._closed or now < self._down_until.get(node, 0.0):
                    continue
                if node not in self._down_until:
                    todo.append(i)
                elif node not in self._probing:  # its window passed: probe, off this thread
                    self._probing.add(node)
                    probes.append(i)
        for i in probes:
            threading.Thread(
                target=self._probe, args=(op, *calls[i]), name="kvwise-redis-probe", daemon=True
            ).start()
        for i in todo:
            try:
                futures[i] = self._io.submit(calls[i][1])
            except RuntimeError:  # closed meanwhile: the pool takes no more work
                break
        if not futures:
            return out
        concurrent.futures.wait(futures.values(), timeout=self.timeout_s)
        for i, future in futures.items():
            node = calls[i][0]
            if future.cancelled():  # closed meanwhile: never ran
                continue
            if not future.done():  # NOTE: its thread is freed once its connection is closed
                future.cancel()
                self._fault(op, node, f"no answer within {self.timeout_s:g} s", outage=True)
            elif future.exception() is not None:
                exc = future.exception()
                # an error reply is no outage; anything else leaves the connection in doubt
                outage = not isinstance(exc, redis.exceptions.ResponseError)
                surprise = None if isinstance(exc, _CLIENT_ERRORS) else exc
                self._fault(op, node, exc, outage, type(exc).__name__, surprise)
            else:
                out[i] = future.result()
        return out

    def wait_probes(self, timeout: float = 5.0) -> bool:
        """Wait until no probe is in flight (tests and tools: a node that was down is up
        again once a call after its window has probed it). False if one still is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._probing:
                    return True
            time.sleep(0.005)
        return False

    def _probe(self, op: str, node: str, run: Callable[[], Any]) -> None:
        """A call to a node that was down, as a probe (its result is dropped: the caller had
        a miss): the node is up again if it answers within the deadline."""
        try:
            future = self._io.submit(run)
        except RuntimeError:  # closed
            with self._lock:
                self._probing.discard(node)
            return
        try:
            future.result(timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a probe's failure is a fault like any call's
            future.cancel()
            if isinstance(exc, concurrent.futures.TimeoutError):
                exc = f"probe: no answer within {self.timeout_s:g} s"  # type: ignore[assignment]
            outage = not isinstance(exc, redis.exceptions.ResponseError)
            kind = "deadline" if isinstance(exc, str) else type(exc).__name__
            surprise = (
                exc
                if isinstance(exc, BaseException) and not isinstance(exc, _CLIENT_ERRORS)
                else None
            )
            self._fault(op, node, exc, outage, kind, surprise)
            if not outage:
                with self._lock:
                    self._down_until.pop(node, None)
        else:
            with self._lock:
                self._down_until.pop(node, None)
        finally:
            with self._lock:
                self._probing.discard(node)

    def _call_here(self, op: str, run: Callable[[], Any]) -> Any:
        """``run()`` on this thread (it touches no network), a fault if it raises."""
        with self._lock:
            if self._closed:
                return _SKIPPED
        try:
            return run()
        except Exception as exc:
            surprise = None if isinstance(exc, _CLIENT_ERRORS) else exc
            self._fault(op, "", exc, False, type(exc).__name__, surprise)
            return _SKIPPED

    def _fault(
        self,
        op: str,
        node: str,
        detail: object,
        outage: bool,
        kind: str = "deadline",
        exc: BaseException | None = None,
    ) -> None:
        """Count a fault of a call to ``node``; an outage also closes the node's connections
        (ending any read stuck on them) and takes it down for ``retry_after_s``."""
        where = f" (node {node})" if node else ""
        with self._lock:
            if outage:
                self._down_until[node] = self._clock() + self.retry_after_s
            self._faults.error(op, f"{kind}{where}", detail, exc)
        if outage:
            self._disconnect(node)

    def _disconnect(self, node: str) -> None:
        """Close every connection to ``node`` (all of them for "" on a cluster), those in use
        by a call in flight included: its blocked read ends at once."""
        try:
            if not self.cluster:
                self._client.connection_pool.disconnect(inuse_connections=True)
            elif self._client is not None and node:
                found = self._client.get_node(node_name=node)
                if found is not None and found.redis_connection is not None:
                    found.redis_connection.connection_pool.disconnect(inuse_connections=True)
            elif self._client is not None:
                self._client.disconnect_connection_pools()
        except Exception:  # best effort: the node is down whatever happens here
            pass


def _replies(values: Any, expected: Sequence[Any]) -> list[Any]:
    """``values`` as one reply per command sent, or ``InvalidResponse``: a server that gives
    anything else (a confused proxy, not Redis) is faulty, not a source of entries."""
    if not isinstance(values, list) or len(values) != len(expected):
        raise redis.exceptions.InvalidResponse(
            f"expected {len(expected)} replies, got {type(values).__name__}"
        )
    return values


def from_config(config: StoreConfig) -> RedisStore | None:
    """The Redis tier ``kv_redis_url`` asks for; None when there is no URL."""
    if not config.kv_redis_url:
        return None
    return RedisStore(
        config.kv_redis_url, ttl_s=config.kv_redis_ttl, timeout_s=config.kv_redis_timeout
    )
