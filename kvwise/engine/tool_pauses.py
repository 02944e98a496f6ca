"""The tool's pause: a turn that ends in tool calls keeps its conversation's KV for the next
turn, which carries the tool's result. Pure Python bookkeeping (no torch).

``finished(request)`` remembers each recently finished request's full-block hashes (bounded);
``pause(request_id)`` (the server calls it for a turn it parsed tool calls from) marks that
turn as waiting for a tool: the engine keeps its blocks in the pool ahead of everything
unkept (``KVCacheManager.retain_cached``, for ``pause_s``), and the tiers hold them as they
hold any finished turn's, so pool pressure moves them to the host tier (then disk) instead of
losing them. ``resumed(request)``, at a request's first token: a turn whose prompt extends a
paused one resumes it; its paused tokens count as found in the pool, loaded from a tier, or
recomputed (evicted from everywhere, or not worth loading). A pause that outlives ``pause_s``
is forgotten (its blocks are then cached like any others, and evicted like them).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from kvwise.core.hashing import BlockHash
from kvwise.core.request import Request


@dataclass
class ToolPauseCounts:
    pauses: int = 0  # turns that ended in tool calls, their KV kept
    resumes: int = 0  # turns carrying a tool's result that extended a paused turn
    resumed_device_tokens: int = 0  # the paused tokens found in the pool
    resumed_tier_tokens: int = 0  # ... loaded from a tier
    recomputed_tokens: int = 0  # ... computed again
    expired: int = 0  # pauses no turn resumed within pause_s


class ToolPauses:
    def __init__(self, pause_s: float = 600.0, capacity: int = 4096, clock=time.monotonic):
        self.pause_s = pause_s
        self.capacity = capacity
        self.clock = clock
        self.counts = ToolPauseCounts()
        self._recent: OrderedDict[str, tuple[str, list[BlockHash]]] = OrderedDict()
        self._paused: dict[tuple[str, BlockHash], tuple[float, int]] = {}

    def finished(self, request: Request, block_size: int) -> None:
        """Remember a finished request's full blocks' hashes (its prompt and answer)."""
        num_full = min(request.num_computed_tokens // block_size, len(request.block_hashes))
        if not num_full:
            return
        self._recent[request.request_id] = (request.tenant, request.block_hashes[:num_full])
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)

    def pause(self, request_id: str) -> tuple[str, list[BlockHash]] | None:
        """Mark a finished turn as waiting for a tool: (its tenant, its block hashes), or None
        when it is not remembered."""
        found = self._recent.pop(request_id, None)
        if found is None:
            return None
        tenant, hashes = found
        self._expire()
        self._paused[(tenant, hashes[-1])] = (self.clock(), len(hashes))
        self.counts.pauses += 1
        return found

    def resumed(self, request: Request, block_size: int) -> bool:
        """At a request's first token: whether it extends a paused turn (then counted, and the
        pause ended)."""
        if not self._paused:
            return False
        self._expire()
        for h in reversed(request.block_hashes):
            entry = self._paused.pop((request.tenant, h), None)
            if entry is None:
                continue
            paused_tokens = entry[1] * block_size
            cached = min(request.num_cached_tokens, paused_tokens)
            loaded = min(request.num_loaded_tokens, cached)
            c = self.counts
            c.resumes += 1
            c.resumed_tier_tokens += loaded
            c.resumed_device_tokens += cached - loaded
            c.recomputed_tokens += paused_tokens - cached
            return True
        return False

    def _expire(self) -> None:
        limit = self.clock() - self.pause_s
        for key in [k for k, (t, _) in self._paused.items() if t < limit]:
            del self._paused[key]
            self.counts.expired += 1
