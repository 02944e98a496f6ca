"""Conversations the engine remembers for ``park``: (tenant, session id) → the chain hashes of
the session's last finished turn. LRU-capped, so a long-running server does not grow."""

from __future__ import annotations

from collections import OrderedDict

from kvwise.core.hashing import BlockHash

MAX_SESSIONS = 100_000  # sessions remembered; the least recently used go first


class SessionMap:
    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._turns: OrderedDict[tuple[str, str], list[BlockHash]] = OrderedDict()

    def record(self, tenant: str, session_id: str, block_hashes: list[BlockHash]) -> None:
        key = (tenant, session_id)
        self._turns[key] = list(block_hashes)
        self._turns.move_to_end(key)
        if len(self._turns) > self.max_sessions:
            self._turns.popitem(last=False)

    def last_turn(self, tenant: str, session_id: str) -> list[BlockHash] | None:
        """The full blocks of the session's last finished turn (None: unknown session)."""
        return self._turns.get((tenant, session_id))

    def __len__(self) -> int:
        return len(self._turns)
