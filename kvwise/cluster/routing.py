"""Cache-aware routing: which replica should serve a request. Pure Python, no Ray.

The router keeps, per replica, the set of block hashes its device pool holds, learnt from the
replica's KV events (``PrefixIndex``). A request arrives as its block-hash chain (hashed the
way the engines hash it: the same tokenizer, block size and tenant-rooted chain, so another
tenant's identical prompt has other hashes and finds nothing). ``choose`` scores each replica
as NVIDIA Dynamo's KV router does — ``overlap_weight × tokens left to prefill + the work it
already has`` (tokens queued for prefill, plus ``running_weight`` × the context of the
sequences decoding: on this engine a running sequence delays a new prompt far less than a
queued one) — and takes the cheapest; with no replica holding any of the prefix, or
when the cheapest is far busier than the least loaded, it falls back to the power of two
choices (two replicas at random, the less loaded one), Ray Serve's default.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvwise.core.hashing import BlockHash
from kvwise.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# the routers a deployment can use (``ray_router.ROUTERS``), named here to stay Ray-free
ROUTING_MODES = ("cache-aware", "power-of-two", "round-robin")


class PrefixIndex:
    """Block hashes held per replica (the device pool's: ``medium == "device"``)."""

    def __init__(self, medium: str = "device") -> None:
        self.medium = medium
        self._held: dict[str, set[BlockHash]] = {}

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(replica, set())
        for event in events:
            if getattr(event, "medium", self.medium) != self.medium:
                continue
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def drop(self, replica: str) -> None:
        """Forget a replica (gone, or restarted with an empty pool)."""
        self._held.pop(replica, None)

    def replace(self, replica: str, hashes: Iterable[BlockHash]) -> None:
        """What a replica holds, all of it (a snapshot)."""
        self._held[replica] = set(hashes)

    def overlap(self, replica: str, chain: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``chain`` the replica holds."""
        held = self._held.get(replica, ())
        n = 0
        for block_hash in chain:
            if block_hash not in held:
                break
            n += 1
        return n

    def num_blocks(self, replica: str) -> int:
        return len(self._held.get(replica, ()))


@dataclass(frozen=True)
class Load:
    """What a replica is busy with, in tokens: prompts queued or prefilling, and sequences
    decoding (their context length)."""

    queued_tokens: int = 0
    running_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.queued_tokens + self.running_tokens

    def work(self, running_weight: float) -> float:
        """Queued tokens (each a prefilled token ahead of a new prompt) plus running tokens
        weighted by ``running_weight``: a sequence decoding costs each step one token and a
        pass over its context, a fraction of what prefilling its context costs."""
        return self.queued_tokens + running_weight * self.running_tokens


class RecentWork:
    """Work a router sent a replica that the replica's published load may not show yet:
    ``(when, prompt tokens)`` by replica and request. An entry goes when the replica
    acknowledges the request (a load it published after admitting it, which counts it), when
    the request completes, or after ``expiry_s`` (an acknowledgement lost on the way)."""

    def __init__(self, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._by_replica: dict[str, dict[str, tuple[float, int]]] = {}

    def add(self, replica: str, request_id: str, now: float, tokens: int) -> None:
        self._by_replica.setdefault(replica, {})[request_id] = (now, tokens)

    def pending(self) -> dict[str, list[str]]:
        """The requests each replica has not acknowledged yet."""
        return {r: list(entries) for r, entries in self._by_replica.items() if entries}

    def acknowledged(self, replica: str, request_ids: Iterable[str]) -> None:
        entries = self._by_replica.get(replica, {})
        for request_id in request_ids:
            entries.pop(request_id, None)

    def completed(self, replica: str, request_id: str) -> None:
        self._by_replica.get(replica, {}).pop(request_id, None)

    def drop(self, replica: str) -> None:
        self._by_replica.pop(replica, None)

    def tokens(self, replica: str, now: float) -> int:
        entries = self._by_replica.get(replica, {})
        for request_id in [k for k, (t, _) in entries.items() if now - t > self.expiry_s]:
            del entries[request_id]
        return sum(tokens for _, tokens in entries.values())


@dataclass(frozen=True)
class Choice:
    replica: str
    overlap_blocks: int  # of the chosen replica
    reason: str  # "cache", "power-of-two" (no overlap anywhere) or "balance" (too busy)


class CacheAwarePolicy:
    def __init__(
        self,
        index: PrefixIndex,
        block_size: int,
        overlap_weight: float = 1.0,
        imbalance_tokens: int = 16_384,
        running_weight: float = 0.1,
        rng: random.Random | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: expected a positive integer, got {block_size}")
        if overlap_weight < 0:
            raise ValueError(f"overlap_weight: expected >= 0, got {overlap_weight}")
        if imbalance_tokens < 0:
            raise ValueError(f"imbalance_tokens: expected >= 0, got {imbalance_tokens}")
        if not 0 <= running_weight <= 1:
            raise ValueError(f"running_weight: expected a number in [0, 1], got {running_weight}")
        self.index = index
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.imbalance_tokens = imbalance_tokens
        self.running_weight = running_weight
        self.rng = rng or random.Random()

    def choose(
        self, chain: Sequence[BlockHash], num_prompt_tokens: int, loads: Mapping[str, Load]
    ) -> Choice:
        """The replica for a prompt of ``num_prompt_tokens`` whose full blocks hash to
        ``chain``, among ``loads``' replicas."""
        if not loads:
            raise ValueError("loads: no replica to choose from")
        overlaps = {r: self.index.overlap(r, chain) for r in loads}
        if max(overlaps.values()) == 0:
            return self._two_choices(loads, overlaps, "power-of-two")

        def cost(replica: str) -> float:
            to_prefill = num_prompt_tokens - overlaps[replica] * self.block_size
            return self.overlap_weight * max(to_prefill, 0) + work[replica]

        work = {r: load.work(self.running_weight) for r, load in loads.items()}
        # NOTE: on a tie the replica holding more of the prompt: a conversation's next turn
        # stays where its KV is (a tie is common: the work routed there a moment ago, still
        # counted, against the prefill the other replica would need)
        best = min(sorted(loads), key=lambda r: (cost(r), -overlaps[r]))
        if work[best] - min(work.values()) > self.imbalance_tokens:
            return self._two_choices(loads, overlaps, "balance")
        return Choice(best, overlaps[best], "cache")

    def _two_choices(self, loads: Mapping[str, Load], overlaps, reason: str) -> Choice:
        replicas = sorted(loads)
        pair = self.rng.sample(replicas, 2) if len(replicas) > 1 else replicas
        pick = min(pair, key=lambda r: (loads[r].work(self.running_weight), -overlaps[r]))
        return Choice(pick, overlaps[pick], reason)
