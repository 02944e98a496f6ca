"""KV events: what a replica's cache gained and lost, for cache-aware routers. Pure Python.

The shape is vLLM's (``vllm.distributed.kv_events``), so routers built for it (llm-d, Dynamo)
can read kvwise's too: ``BlockStored`` (block hashes, the parent of the first, block size, the
medium holding them), ``BlockRemoved`` (hashes, medium) and ``AllBlocksCleared``. Unlike vLLM,
``BlockStored`` never carries token ids: a router learns hashes, never text. kvwise's hashes
descend from a (model, tenant, salt) root, so the same prompt of two tenants never shares one.

``KVEventLog`` buffers events until the engine hands them out (``drain``); it is bounded: past
``max_events`` the oldest are dropped and counted, and a router that misses events only
routes worse, it never serves wrong KV (the replica looks its prefix up itself).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvwise.core.hashing import BlockHash

DEVICE = "device"  # the medium names: the device pool, then the store's tiers by name


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # of the block before the first; None: a chain's root
    block_size: int
    medium: str = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str = DEVICE


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    block_size: int
    max_events: int = 100_000
    dropped: int = 0  # events dropped because nobody drained them in time
    _events: deque = field(default_factory=deque)

    def stored(self, hashes: Sequence[BlockHash], parent: BlockHash | None, medium: str = DEVICE):
        if hashes:
            self._add(BlockStored(list(hashes), parent, self.block_size, medium))

    def removed(self, hashes: Sequence[BlockHash], medium: str = DEVICE) -> None:
        if not hashes:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:  # one event per run
            last.block_hashes.extend(hashes)
            return
        self._add(BlockRemoved(list(hashes), medium))

    def drain(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def _add(self, event: KVEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)
