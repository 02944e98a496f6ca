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
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvwise.store.base import FaultLog, TierStats
from kvwise.store.index import check_key, check_value

if TYPE_CHECKING:
    from kvwise.config import StoreConfig

_SCHEMES = ("redis", "rediss", "unix")
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
                f"unix://), got scheme {scheme!r}"
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
        self._down_until = 0.0
        self._closed = False
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # redis-py retries 3 times by default
                health_check_interval=0,
            )
        except ValueError as exc:
            raise ValueError(f"kv_redis_url: {exc}") from None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        if not names:
            return []

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        found = self._call("contains", run)
        if found is _SKIPPED:
            return [False] * len(names)
        return [bool(n) for n in found]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        names = self._names(keys)
        if not names:
            return []
        start = time.perf_counter()
        values = self._call("get", lambda: self._client.mget(names))
        if values is _SKIPPED:
            return [None] * len(names)
        num_hits = sum(v is not None for v in values)
        with self._lock:
            self.stats.hits += num_hits
            self.stats.misses += len(names) - num_hits
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

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for name, value, _ in checked:
                pipe.set(name, value if isinstance(value, bytes) else bytes(value), ex=ex)
            return pipe.execute()

        if self._call("put", run) is _SKIPPED:
            return False  # a fault (server down, timeout) or the breaker open: nothing stored
        with self._lock:
            self.stats.bytes_written += sum(num_bytes for _, _, num_bytes in checked)
        return True

    def delete(self, keys: Sequence[bytes]) -> None:
        names = self._names(keys)
        if names:
            self._call("delete", lambda: self._client.delete(*names))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._client.close()
            self._client.connection_pool.disconnect()
        except (redis.exceptions.RedisError, OSError):
            pass

    def describe(self) -> str:
        # NOTE: never the URL: it may hold a password
        return "redis"

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.prefix + check_key(k).hex() for k in keys]

    def _call(self, op: str, run: Callable[[], Any]) -> Any:
        """``run()``'s result, or ``_SKIPPED`` if closed, down, or it faulted."""
        with self._lock:
            if self._closed or self._clock() < self._down_until:
                return _SKIPPED
        try:
            return run()
        except (redis.exceptions.RedisError, OSError) as exc:
            with self._lock:
                if not isinstance(exc, redis.exceptions.ResponseError):
                    self._down_until = self._clock() + self.retry_after_s
                self._faults.fault(type(exc).__name__, f"in {op}: {exc}")
            return _SKIPPED


def from_config(config: StoreConfig) -> RedisStore | None:
    """The Redis tier ``kv_redis_url`` asks for; None when there is no URL."""
    if not config.kv_redis_url:
        return None
    return RedisStore(
        config.kv_redis_url, ttl_s=config.kv_redis_ttl, timeout_s=config.kv_redis_timeout
    )
