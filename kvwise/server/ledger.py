"""A bill per tenant: every ended sequence's tokens, by tenant and kind, since start and over
the last day (``GET /v1/usage`` reads it; ``price_sheet.py`` prices it).

Kinds (``KINDS``), each prompt token in exactly one of the first four:

- ``input``: prompt tokens computed and not written to a cache with a TTL (the uncached
  remainder);
- ``cache_read``: prompt tokens read from the cache (the device pool's prefix hits and the
  tokens loaded from the tiers: the engine's ``num_cached_tokens``, OpenAI's
  ``cached_tokens``, Anthropic's ``cache_read_input_tokens``);
- ``cache_write_5m`` / ``cache_write_1h``: prompt tokens computed and kept for a 5-minute /
  1-hour ``cache_control`` breakpoint (Anthropic's ``cache_creation``), from the engine's
  per-request counts by TTL (``RequestOutput.cache_created_tokens``, split by
  ``cache_usage.cache_creation`` as Anthropic's usage is: a TTL of an hour or more is a
  1-hour write, a shorter one a 5-minute write);
- ``output``: tokens generated (a completion's echo-only token, which its usage reports as
  none, is not billed).

``Generation.ended`` bills each sequence once, as it ends (finished, aborted or hung up), with
what its last output says, so every dialect's routes are billed alike. A request of n choices
bills its prompt once, with its first choice (as every dialect's ``usage`` reports it); an
aborted sequence bills what it computed before it ended.

Bounds: exact totals since start for at most ``max_tenants`` tenants by name (tenants are the
API keys' tenants, ``default`` without keys: a configured set, not the traffic's); past that a
new tenant is billed in the row ``OTHER_TENANTS``. For ``since``, one bucket per ``bucket_s``
(60 s) over the last ``retention_s`` (24 h): at most 1,440 buckets, each with a row per tenant
active in it. The Prometheus series ``kvwise_tenant_tokens_total{tenant,kind}`` read the
totals at scrape time (``TenantTokensCollector``). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from prometheus_client.core import CounterMetricFamily

from kvwise.server.cache_usage import cache_creation
from kvwise.server.request_stats import OTHER_TENANTS
from kvwise.types import RequestOutput

KINDS = ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output")
DEFAULT_BUCKET_S = 60
DEFAULT_RETENTION_S = 24 * 3600
DEFAULT_MAX_TENANTS = 256


@dataclass
class TokenBill:
    """Tokens of one tenant by kind (``KINDS``), and the sequences they came from."""

    input: int = 0
    cache_read: int = 0
    cache_write_5m: int = 0
    cache_write_1h: int = 0
    output: int = 0
    sequences: int = 0

    @property
    def prompt(self) -> int:
        """Every prompt token billed: input + cache reads + cache writes."""
        return self.input + self.cache_read + self.cache_write_5m + self.cache_write_1h

    def add(self, other: TokenBill) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        """The kinds, ``prompt`` (their prompt tokens) and ``sequences``: JSON-ready."""
        kinds = {kind: getattr(self, kind) for kind in KINDS}
        return {**kinds, "prompt": self.prompt, "sequences": self.sequences}


def bill_of(out: RequestOutput | None, bill_prompt: bool = True, bill_output: bool = True):
    """One ended sequence's bill from its last output (None: it ended before any output, and
    bills nothing but itself). ``bill_prompt`` False: a later choice of a prompt its first
    choice bills; ``bill_output`` False: its output is not answered (completions' echo)."""
    if out is None:
        return TokenBill(sequences=1)
    bill = TokenBill(output=len(out.token_ids) if bill_output else 0, sequences=1)
    if bill_prompt:
        write_5m, write_1h = cache_creation(out)  # as the Messages route's usage counts them
        read = int(out.num_cached_tokens)
        bill.cache_read, bill.cache_write_5m, bill.cache_write_1h = read, write_5m, write_1h
        bill.input = max(0, out.num_prompt_tokens - read - write_5m - write_1h)
    return bill


class UsageLedger:
    """Each tenant's ``TokenBill`` since start, and per bucket over the last ``retention_s``
    (see the module docstring).

    Args:
        clock: unix seconds (tests pass their own).
    """

    def __init__(
        self,
        bucket_s: int = DEFAULT_BUCKET_S,
        retention_s: int = DEFAULT_RETENTION_S,
        max_tenants: int = DEFAULT_MAX_TENANTS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if bucket_s < 1 or retention_s < bucket_s or max_tenants < 1:
            raise ValueError(
                "usage ledger: bucket_s >= 1, retention_s >= bucket_s and max_tenants >= 1"
            )
        self.bucket_s = bucket_s
        self.retention_s = retention_s
        self.max_tenants = max_tenants
        self.num_buckets = retention_s // bucket_s
        self.clock = clock
        self.started_s = clock()
        self._totals: dict[str, TokenBill] = {}
        self._buckets: deque[tuple[int, dict[str, TokenBill]]] = deque()  # (index, rows)
        self._lock = threading.Lock()

    def record(self, tenant: str, bill: TokenBill) -> None:
        """Add ``bill`` to ``tenant``'s totals and to the bucket of now."""
        with self._lock:
            if tenant not in self._totals and len(self._totals) >= self.max_tenants:
                tenant = OTHER_TENANTS
            self._totals.setdefault(tenant, TokenBill()).add(bill)
            index = int(self.clock() // self.bucket_s)
            if not self._buckets or self._buckets[-1][0] < index:
                self._buckets.append((index, {}))
            # (a clock that stepped back: the newest bucket takes it)
            self._buckets[-1][1].setdefault(tenant, TokenBill()).add(bill)
            self._prune(index)

    def _prune(self, index: int) -> None:
        oldest = index - self.num_buckets + 1
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def start_of(self, since_s: float | None) -> float:
        """Where a bill since ``since_s`` starts: the start of the bucket holding it (None:
        since start). ValueError naming ``since`` when those buckets are gone."""
        if since_s is None:
            return self.started_s
        now = self.clock()
        index = int(since_s // self.bucket_s)
        oldest = int(now // self.bucket_s) - self.num_buckets + 1
        if index < oldest and self.started_s < oldest * self.bucket_s:
            raise ValueError(
                f"since: {since_s:.0f} is older than the last {self.retention_s // 3600} h "
                f"this server keeps per {self.bucket_s} s (from {oldest * self.bucket_s})"
            )
        return max(index * self.bucket_s, 0)

    def bills(
        self, tenant: str | None = None, since_s: float | None = None
    ) -> dict[str, TokenBill]:
        """Each tenant's bill (only ``tenant``'s, zeros if it has none), since start or since
        the start of the bucket holding ``since_s`` (``start_of``'s ValueError)."""
        self.start_of(since_s)  # the check
        with self._lock:
            self._prune(int(self.clock() // self.bucket_s))
            if since_s is None:
                rows = {name: TokenBill(**asdict(b)) for name, b in self._totals.items()}
            else:
                first = int(since_s // self.bucket_s)
                rows = {}
                for index, bucket in self._buckets:
                    if index >= first:
                        for name, b in bucket.items():
                            rows.setdefault(name, TokenBill()).add(b)
        if tenant is not None:
            return {tenant: rows.get(tenant, TokenBill())}
        return dict(sorted(rows.items()))


class TenantTokensCollector:
    """``kvwise_tenant_tokens_total{tenant,kind}``: the ledger's totals at scrape time."""

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger

    def collect(self):
        family = CounterMetricFamily(
            "kvwise_tenant_tokens",
            "tokens billed to the tenant by kind: input (uncached prompt), cache_read, "
            "cache_write_5m, cache_write_1h, output",
            labels=["tenant", "kind"],
        )
        for tenant, bill in self.ledger.bills().items():
            for kind in KINDS:
                family.add_metric([tenant, kind], getattr(bill, kind))
        yield family
