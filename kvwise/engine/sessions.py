"""Conversations the engine remembers for ``park``: (tenant, session id) → the chain hashes of
the session's last finished turn.

Bounded in bytes, in total and per tenant, so that a long-running server does not grow and no
tenant can push out another's sessions:

- each tenant's sessions are an LRU of their own; a tenant over ``max_bytes_per_tenant`` loses
  its own least recently used session;
- when all of them together are over ``max_bytes``, the least recently used session of the
  tenant holding the most bytes goes (so a tenant that floods the map evicts only its own
  sessions while it holds more than any other).

A session's size is its ids' characters plus 32 bytes a block hash plus a fixed overhead.
"""

from __future__ import annotations

from collections import OrderedDict

from kvwise.core.hashing import BlockHash

MAX_SESSION_BYTES = 64 * 2**20  # all sessions together
_ENTRY_OVERHEAD = 200  # bytes a session costs beyond its ids and hashes (dict, list, tuple)


def session_bytes(tenant: str, session_id: str, block_hashes: list[BlockHash]) -> int:
    return _ENTRY_OVERHEAD + len(tenant) + len(session_id) + 32 * len(block_hashes)


class SessionMap:
    """``record`` a session's last turn, ``last_turn`` to read it back.

    Args:
        max_bytes: bytes all sessions may take together.
        max_bytes_per_tenant: bytes one tenant's sessions may take (None: ``max_bytes``).
    """

    def __init__(
        self, max_bytes: int = MAX_SESSION_BYTES, max_bytes_per_tenant: int | None = None
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: expected > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_bytes_per_tenant = (
            max_bytes if max_bytes_per_tenant is None else max_bytes_per_tenant
        )
        self._turns: dict[str, OrderedDict[str, list[BlockHash]]] = {}  # tenant → LRU
        self._tenant_bytes: dict[str, int] = {}
        self.num_bytes = 0
        self.num_evicted = 0

    def record(self, tenant: str, session_id: str, block_hashes: list[BlockHash]) -> None:
        self._remove(tenant, session_id)
        hashes = list(block_hashes)
        size = session_bytes(tenant, session_id, hashes)
        if size > self.max_bytes_per_tenant:
            return  # too large to remember at all: park finds no such session
        turns = self._turns.setdefault(tenant, OrderedDict())
        turns[session_id] = hashes
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.num_bytes += size
        while self._tenant_bytes[tenant] > self.max_bytes_per_tenant:
            self._evict_oldest(tenant)
        while self.num_bytes > self.max_bytes:
            self._evict_oldest(max(self._tenant_bytes, key=self._tenant_bytes.__getitem__))

    def last_turn(self, tenant: str, session_id: str) -> list[BlockHash] | None:
        """The full blocks of the session's last finished turn (None: unknown session)."""
        turns = self._turns.get(tenant)
        if turns is None or session_id not in turns:
            return None
        turns.move_to_end(session_id)
        return turns[session_id]

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def __len__(self) -> int:
        return sum(len(turns) for turns in self._turns.values())

    def _evict_oldest(self, tenant: str) -> None:
        session_id = next(iter(self._turns[tenant]))
        self._remove(tenant, session_id)
        self.num_evicted += 1

    def _remove(self, tenant: str, session_id: str) -> None:
        turns = self._turns.get(tenant)
        if turns is None or session_id not in turns:
            return
        size = session_bytes(tenant, session_id, turns.pop(session_id))
        self._tenant_bytes[tenant] -= size
        self.num_bytes -= size
        if not turns:
            del self._turns[tenant], self._tenant_bytes[tenant]
