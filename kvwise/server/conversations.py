"""The Responses API's stored responses (``store: true``): each response with its whole
conversation (the items that led to it and its output), so that a next turn naming it as
``previous_response_id`` sends only its new items, and ``GET`` / ``DELETE
/v1/responses/{id}`` find it.

Kept per tenant and looked up by (tenant, id) only: another tenant's id is a miss on the same
path as an id that never existed (the same 404, the same work). Bounded per tenant, so one
tenant's traffic never evicts another's: at most ``max_responses`` responses and
``max_bytes`` bytes (each response counted with its whole conversation as JSON, as if it
held a copy; turns share their items, so the memory held is less), each kept ``ttl_s``
seconds after it was stored or last continued; past a bound the least recently used go
first. A response larger than ``max_bytes`` alone is not stored. Runs on the event loop only
(no locks)."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_RESPONSES = 10_000


@dataclass(frozen=True)
class StoreLimits:
    """The bounds of each tenant's stored responses (``--responses-store-*``)."""

    ttl_s: float = DEFAULT_TTL_S
    max_bytes: int = DEFAULT_MAX_BYTES
    max_responses: int = DEFAULT_MAX_RESPONSES

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"responses_store_ttl: expected seconds > 0, got {self.ttl_s}")
        if self.max_bytes < 1:
            raise ValueError(f"responses_store_memory: expected > 0 bytes, got {self.max_bytes}")
        if self.max_responses < 1:
            raise ValueError(f"responses_store_max: expected at least 1, got {self.max_responses}")


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    items: list[dict[str, Any]]  # the conversation: every input item, then the output's
    items_bytes: int  # the conversation's size as JSON
    num_bytes: int  # what it counts against its tenant's max_bytes
    expires_at: float = field(default=0.0)


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())


class ResponseStore:
    """Responses by tenant and id, within ``StoreLimits`` per tenant."""

    def __init__(
        self, limits: StoreLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or StoreLimits()
        self.clock = clock
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}

    def get(self, tenant: str, response_id: str, touch: bool = False) -> StoredResponse | None:
        """The tenant's stored response, or None (never stored, expired, deleted, evicted, or
        another tenant's). ``touch``: it is continued, so it is kept ``ttl_s`` from now."""
        entries = self._tenants.get(tenant)
        entry = entries.get(response_id) if entries is not None else None
        if entry is None:
            return None
        now = self.clock()
        if entry.expires_at <= now:
            self._drop(tenant, response_id)
            return None
        if touch:
            entry.expires_at = now + self.limits.ttl_s
            entries.move_to_end(response_id)  # type: ignore[union-attr]
        return entry

    def put(
        self,
        tenant: str,
        response: dict[str, Any],
        items: list[dict[str, Any]],
        previous: StoredResponse | None = None,
    ) -> bool:
        """Store ``response`` (its ``id``) with its conversation ``items``; ``previous``: the
        stored response whose conversation ``items`` begin with (its size is known). False
        when it alone is over ``max_bytes`` (not stored)."""
        shared = len(previous.items) if previous is not None else 0
        items_bytes = (previous.items_bytes if previous is not None else 0) + sum(
            _size(item) for item in items[shared:]
        )
        num_bytes = items_bytes + _size(response)
        if num_bytes > self.limits.max_bytes:
            return False
        entries = self._tenants.setdefault(tenant, OrderedDict())
        response_id = response["id"]
        if response_id in entries:
            self._drop(tenant, response_id)
        now = self.clock()
        entries[response_id] = StoredResponse(
            response, items, items_bytes, num_bytes, now + self.limits.ttl_s
        )
        self._bytes[tenant] = self._bytes.get(tenant, 0) + num_bytes
        self._evict(tenant, now)
        return True

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the tenant's response; False when it has none of that id."""
        if self.get(tenant, response_id) is None:
            return False
        self._drop(tenant, response_id)
        return True

    def usage(self, tenant: str) -> tuple[int, int]:
        """(responses, bytes) the tenant's store holds now."""
        self._evict(tenant, self.clock())
        return len(self._tenants.get(tenant, ())), self._bytes.get(tenant, 0)

    def _drop(self, tenant: str, response_id: str) -> None:
        entry = self._tenants[tenant].pop(response_id)
        self._bytes[tenant] -= entry.num_bytes

    def _evict(self, tenant: str, now: float) -> None:
        """Expired entries, then the least recently used past the bounds (oldest first: the
        order of the tenant's dict is that of their expiry)."""
        entries = self._tenants.get(tenant)
        if not entries:
            return
        limits = self.limits
        while entries:
            oldest_id, oldest = next(iter(entries.items()))
            over = len(entries) > limits.max_responses or self._bytes[tenant] > limits.max_bytes
            if oldest.expires_at > now and not over:
                break
            self._drop(tenant, oldest_id)
