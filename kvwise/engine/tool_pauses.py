"""The tool's pause: a turn that ends in tool calls keeps its conversation's KV for the next
turn, which carries the tool's result. Pure Python bookkeeping (no torch).

``finished(request)`` remembers each recently finished request's full-block hashes (bounded);
``pause(request_id)`` (the server calls it for a turn it parsed tool calls from) marks that
turn as waiting for a tool: the engine keeps its blocks in the pool ahead of everything
unkept (``KVCacheManager.retain_cached``, for ``pause_s``), and the tiers hold them as they
hold any finished turn's, so pool pressure moves them to the host tier (then disk) instead of
losing them. ``resumed(request)``, at a request's first token: a turn whose prompt repeats a
paused turn's whole prompt, and perhaps some of its answer, and is longer than that turn (its
prompt and answer) resumes it, by the longest such prefix: the next prompt may write the call
back with other tokens than the model generated and part ways inside the answer; another
conversation that only shares a system prompt with it, or the same prompt sent again, resumes
nothing. The paused tokens it repeats count as found in the pool, loaded from a tier, or
recomputed (evicted from everywhere, or not worth loading). A pause that outlives
``pause_s``, or the oldest beyond ``capacity`` pauses, is forgotten (its blocks are then cached
like any others, and evicted like them).
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
        # finished turns by request id: (tenant, block hashes, full blocks of the prompt)
        self._recent: OrderedDict[str, tuple[str, list[BlockHash], int]] = OrderedDict()
        self._next_id = 0
        # paused turns by id, oldest first: (paused at, tenant, block hashes, first indexed)
        self._paused: OrderedDict[int, tuple[float, str, list[BlockHash], int]] = OrderedDict()
        # (tenant, block hash) -> (pause id, the block's index), for a pause's blocks from its
        # prompt's last full one on: where a prompt that repeats the paused one leaves it
        self._index: dict[tuple[str, BlockHash], tuple[int, int]] = {}

    def finished(self, request: Request, block_size: int) -> None:
        """Remember a finished request's full blocks' hashes (its prompt and answer)."""
        num_full = min(request.num_computed_tokens // block_size, len(request.block_hashes))
        if not num_full:
            return
        prompt_blocks = min(request.num_prompt_tokens // block_size, num_full)
        self._recent[request.request_id] = (
            request.tenant,
            request.block_hashes[:num_full],
            prompt_blocks,
        )
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)

    def pause(self, request_id: str) -> tuple[str, list[BlockHash]] | None:
        """Mark a finished turn as waiting for a tool: (its tenant, its block hashes), or None
        when it is not remembered."""
        found = self._recent.pop(request_id, None)
        if found is None:
            return None
        tenant, hashes, prompt_blocks = found
        self._expire()
        pause_id, self._next_id = self._next_id, self._next_id + 1
        first = max(0, prompt_blocks - 1)
        self._paused[pause_id] = (self.clock(), tenant, hashes, first)
        for i in range(first, len(hashes)):  # a later pause takes it over
            self._index[(tenant, hashes[i])] = (pause_id, i)
        while len(self._paused) > self.capacity:
            self._forget(next(iter(self._paused)))
        self.counts.pauses += 1
        return tenant, hashes

    def resumed(self, request: Request, block_size: int) -> bool:
        """At a request's first token: whether its prompt repeats a paused turn's prefix (then
        counted, and the pause ended)."""
        if not self._paused:
            return False
        self._expire()
        for h in reversed(request.block_hashes):
            pause_id, index = self._index.get((request.tenant, h), (None, 0))
            if pause_id is None or pause_id not in self._paused:
                continue
            if request.num_prompt_tokens <= len(self._paused[pause_id][2]) * block_size:
                return False  # the paused turn's prompt again, not its tool's result
            self._forget(pause_id)
            paused_tokens = (index + 1) * block_size  # the paused prefix this prompt repeats
            cached = min(request.num_cached_tokens, paused_tokens)
            loaded = min(request.num_loaded_tokens, cached)
            c = self.counts
            c.resumes += 1
            c.resumed_tier_tokens += loaded
            c.resumed_device_tokens += cached - loaded
            c.recomputed_tokens += paused_tokens - cached
            return True
        return False

    def _forget(self, pause_id: int) -> None:
        _, tenant, hashes, first = self._paused.pop(pause_id)
        for h in hashes[first:]:
            key = (tenant, h)
            if self._index.get(key, (None,))[0] == pause_id:
                del self._index[key]

    def _expire(self) -> None:
        limit = self.clock() - self.pause_s
        while self._paused:
            pause_id, (paused_at, *_) = next(iter(self._paused.items()))
            if paused_at >= limit:
                break
            self._forget(pause_id)
            self.counts.expired += 1
