"""Bounded per-request bookkeeping for the dashboard and /metrics: the TTFTs of the requests
that finished last (``RecentValues``, for percentiles over time) and the totals of each tenant
(``TenantTable``). Both are fixed in size whatever the traffic: a flood of requests or of
tenants cannot grow them. Thread-safe (the event loop writes, the dashboard's thread and the
scrape read)."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, replace

from kvwise.core.stat_fields import metric

OTHER_TENANTS = "(other)"  # the row of the tenants that have no row of their own


class RecentValues:
    """The last ``maxlen`` values observed and how many were ever observed, so a reader that
    remembers the count it saw last can take exactly the values since (``since``)."""

    def __init__(self, maxlen: int = 256) -> None:
        if maxlen < 1:
            raise ValueError("maxlen: must be >= 1")
        self._values: deque[float] = deque(maxlen=maxlen)
        self._num_seen = 0
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)
            self._num_seen += 1

    def snapshot(self) -> tuple[int, tuple[float, ...]]:
        """``(values ever observed, the last maxlen of them, oldest first)``."""
        with self._lock:
            return self._num_seen, tuple(self._values)


def since(values: tuple[float, ...], num_seen: int, num_seen_before: int) -> tuple[float, ...]:
    """Of ``values`` (the last ones of ``num_seen`` observed), those observed after the first
    ``num_seen_before``: at most all of ``values``."""
    num_new = num_seen - num_seen_before
    if num_new <= 0:
        return ()
    return values[max(0, len(values) - num_new) :]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q)) - 1]


@dataclass
class TenantCounts:
    """One tenant's totals since start (or since its row was folded into the other row); each
    field names its metric (``core.stat_fields``), labelled ``tenant`` in /metrics."""

    num_requests: int = metric(
        "kvwise_tenant_requests", "finished generation requests of the tenant", default=0
    )
    num_prompt_tokens: int = metric(
        "kvwise_tenant_prompt_tokens", "prompt tokens of the tenant's requests", default=0
    )
    num_generated_tokens: int = metric(
        "kvwise_tenant_generated_tokens", "tokens generated for the tenant", default=0
    )
    num_cached_tokens: int = metric(
        "kvwise_tenant_cached_prompt_tokens",
        "prompt tokens of the tenant's requests read from the prefix cache",
        default=0,
    )

    def add(self, other: TenantCounts) -> None:
        self.num_requests += other.num_requests
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_generated_tokens += other.num_generated_tokens
        self.num_cached_tokens += other.num_cached_tokens


class TenantTable:
    """Each tenant's finished requests and tokens, for at most ``max_tenants`` tenants by name.

    When a tenant with no row comes and the table is full, the tenant with the fewest requests
    gives up its row: its totals move to the row ``OTHER_TENANTS``, and the newcomer starts a
    row of its own. So the busiest tenants keep exact rows, a flood of new tenants churns one
    row, and the rows together always add up to every request counted. (A tenant named
    ``OTHER_TENANTS`` itself is counted in that row.)
    """

    def __init__(self, max_tenants: int = 50) -> None:
        if max_tenants < 1:
            raise ValueError("max_tenants: must be >= 1")
        self.max_tenants = max_tenants
        self._rows: dict[str, TenantCounts] = {}
        self._other = TenantCounts()
        self._lock = threading.Lock()

    def record(
        self, tenant: str, num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int
    ) -> None:
        """Count one finished request of ``tenant`` (tokens 0 when it produced no output)."""
        with self._lock:
            row = self._other if tenant == OTHER_TENANTS else self._rows.get(tenant)
            if row is None:
                if len(self._rows) >= self.max_tenants:
                    smallest = min(self._rows, key=lambda name: self._rows[name].num_requests)
                    self._other.add(self._rows.pop(smallest))
                row = self._rows[tenant] = TenantCounts()
            row.num_requests += 1
            row.num_prompt_tokens += num_prompt_tokens
            row.num_generated_tokens += num_generated_tokens
            row.num_cached_tokens += num_cached_tokens

    def rows(self) -> list[tuple[str, TenantCounts]]:
        """Copies of the rows, most requests first (ties by name), then the other row if it
        counted anything."""
        with self._lock:
            rows = [(name, replace(counts)) for name, counts in self._rows.items()]
            other = replace(self._other)
        rows.sort(key=lambda row: (-row[1].num_requests, row[0]))
        if other.num_requests:
            rows.append((OTHER_TENANTS, other))
        return rows
