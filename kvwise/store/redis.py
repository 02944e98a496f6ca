"""The Redis tier: entries shared between engines through a Redis server.

One Redis key per entry, ``prefix + key.hex()``, whose value is the entry bytes (header and
payload together, so there is never a payload without its header). Every entry gets a TTL of
at least the store's ``ttl_s``; Redis expires and evicts entries itself.

Contract (on top of ``base.KVStore``):
- One round trip per call: ``get`` is one MGET, ``contains`` and ``put`` one
  non-transactional pipeline (EXISTS, SET ... EX), ``delete`` one DEL.
- A Redis error, socket error or timeout (``timeout_s``, for connect and for each reply) is a
  fault: counted, logged once per kind, served as a miss. After a connection-level fault
  (server down, timeout, refused login) the store is *down* for ``retry_after_s``: calls
  answer misses at once, with no network and no stats, so a dead server costs one timeout,
  not one per request. An error reply (e.g. OOM on SET) is a fault but not an outage.
- Nothing touches the network before the first call: an unreachable server at start-up is a
  fault on first use, not an exception.
- Stats: ``evictions`` stays 0 and the ``num_entries``/``num_bytes`` gauges stay 0: Redis
  expires and evicts on its own and the server is shared, so this process cannot know what
  it holds (``bytes_written`` says what this process sent).
- Thread safety: redis-py's client draws connections from a thread-safe pool; this store
  locks only its own counters and outage state.

Redis Cluster (``redis+cluster://`` / ``rediss+cluster://``, any node as the seed): entry keys
are HMACs, so they spread over every hash slot. Each call groups its keys by the node that
serves their slot and sends each node one non-transactional pipeline of single-key commands
(GET, EXISTS, SET, DEL: no multi-key command has to stay within one slot). A node's fault
and outage window are its own: its entries are misses while the other nodes keep serving.
The cluster's slot map is read on the first call, not at start-up.
"""

from __future__ import annotations

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

from kvwise.store.base import FaultLog, TierStats
from kvwise.store.index import check_key, check_value

if TYPE_CHECKING:
    from kvwise.config import StoreConfig

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_SKIPPED = object()  # the call did not reach the server (closed, down, or a fault)


class RedisStore:
    """Redis tier. ``RedisStore("redis://:password@127.0.0.1:6379/0", ttl_s=3600)``.

    Args:
        url: ``redis://[[user]:password@]host:port/db``, ``rediss://...`` or ``unix://...``.
        ttl_s: minimum TTL of every entry, in seconds.
        timeout_s: connect and reply timeout of each call.
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
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.prefix = prefix
        self.stats = TierStats()
        self._clock = clock
        self._faults = FaultLog(self.name, self.stats)
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}  # per node ("" for a single server)
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
        try:
            if not self.cluster:
                self._client = redis.Redis.from_url(url, health_check_interval=0, **options)
            else:
                redis.connection.parse_url(self._cluster_url)  # a bad URL fails now, not later
        except ValueError as exc:
            raise ValueError(f"kv_redis_url: {exc}") from None

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
            values = self._call("get", lambda: self._client.mget(names))
            if values is _SKIPPED:
                values = [_SKIPPED] * len(names)
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

    def put(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float | None = None) -> bool:
        checked = [(self.prefix + check_key(k).hex(), v, check_value(v)) for k, v in items]
        if not checked:
            return True
        ex = max(1, math.ceil(max(self.ttl_s, ttl_s or 0.0)))
        values = {name: value for name, value, _ in checked}

        def add(pipe, name: str) -> None:
            value = values[name]
            pipe.set(name, value if isinstance(value, bytes) else bytes(value), ex=ex)

        done = self._per_node("put", [name for name, _, _ in checked], add)
        stored = [c for c, d in zip(checked, done, strict=True) if d is not _SKIPPED]
        with self._lock:
            self.stats.bytes_written += sum(num_bytes for _, _, num_bytes in stored)
        # False: a fault (server or node down, timeout) or the breaker open: not all stored
        return len(stored) == len(checked)

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
        if self._client is None:
            return
        try:
            self._client.close()
            if not self.cluster:
                self._client.connection_pool.disconnect()
        except (redis.exceptions.RedisError, OSError):
            pass

    def describe(self) -> str:
        # NOTE: never the URL: it may hold a password
        return "redis"

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.prefix + check_key(k).hex() for k in keys]

    def _per_node(self, op: str, names: list[str], add: Callable[[Any, str], Any]) -> list[Any]:
        """One pipeline a node of ``add(pipe, name)`` commands; the results in ``names``'
        order, ``_SKIPPED`` where the node was down or faulted."""
        results: list[Any] = [_SKIPPED] * len(names)
        if not names:
            return results
        groups = self._call(op, lambda: self._groups(names))
        if groups is _SKIPPED:
            return results
        for node, client, indices in groups:

            def run(client=client, indices=indices) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for i in indices:
                    add(pipe, names[i])
                return pipe.execute()

            out = self._call(op, run, node)
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
        return [(key, self._client.get_redis_connection(node), indices)
                for key, (node, indices) in by_node.items()]  # fmt: skip

    def _call(self, op: str, run: Callable[[], Any], node: str = "") -> Any:
        """``run()``'s result, or ``_SKIPPED`` if closed, ``node`` down, or it faulted."""
        with self._lock:
            if self._closed or self._clock() < self._down_until.get(node, 0.0):
                return _SKIPPED
        try:
            return run()
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException,
                OSError) as exc:  # fmt: skip
            with self._lock:
                if not isinstance(exc, redis.exceptions.ResponseError):
                    self._down_until[node] = self._clock() + self.retry_after_s
                where = f" (node {node})" if node else ""
                self._faults.fault(type(exc).__name__, f"in {op}{where}: {exc}")
            return _SKIPPED


def from_config(config: StoreConfig) -> RedisStore | None:
    """The Redis tier ``kv_redis_url`` asks for; None when there is no URL."""
    if not config.kv_redis_url:
        return None
    return RedisStore(
        config.kv_redis_url, ttl_s=config.kv_redis_ttl, timeout_s=config.kv_redis_timeout
    )
