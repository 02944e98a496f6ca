"""What the scheduler needs from the tiers below the device pool, as a protocol. Pure Python.

The scheduler plans; the tiers (``kvwise.store.TieredStore`` implements ``KVTierPlanner``) do
the I/O. At admission the scheduler asks ``plan_load`` how much of a device prefix hit's
continuation to load (a ``LoadPlan``: nothing is read yet); when the step's loads come up
short it calls ``roll_back``; when a request leaves the pool, ``plan_writes`` says which of its
chunks the tiers lack, and ``plan_keeps`` and ``keep`` refresh the keeps (a cache
breakpoint's or a retention's TTL) of those they hold already. The plan types are plain data the scheduler owns and hands to the
worker boundary (``core/outputs.py``).

The tiers store a sequence as *entries*: runs of consecutive blocks, each found by its last
block's chain hash (which names the whole prefix it ends). A sequence is cut into entries at
every multiple of ``chunk_blocks`` and at a few more points where another request is likely
to stop sharing it (see ``plan_writes``); a load reads, for each run of blocks it wants, the
entry that ends with the run's last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvwise.core.hashing import BlockHash


@dataclass(frozen=True)
class PlannedChunk:
    """A run of blocks to load into fresh device blocks from the stored entry that ends with
    the run's last block (the entry may start earlier: its leading blocks are skipped)."""

    first_block: int  # sequence index of the run's first block
    num_blocks: int
    block_hashes: tuple[BlockHash, ...]  # the prompt's hashes of the run's blocks
    tiers: tuple[str, ...]  # the tier each layer group is read from

    @property
    def key(self) -> BlockHash:
        """The chain hash the entry is found by: its last block's."""
        return self.block_hashes[-1]


@dataclass(frozen=True)
class LoadPlan:
    """Blocks to load after a request's device prefix hit, chunk by chunk."""

    num_blocks: int  # blocks to load after the device prefix
    chunks: list[PlannedChunk]


@dataclass(frozen=True)
class ChunkWrite:
    """One entry of a sequence leaving the pool that the tiers should store."""

    first_block: int
    block_hashes: tuple[BlockHash, ...]
    num_tiers: int | None = None  # write to the first this many tiers (None: all)

    @property
    def key(self) -> BlockHash:
        """The chain hash the entry is found by: its last block's."""
        return self.block_hashes[-1]


@runtime_checkable
class KVTierPlanner(Protocol):
    """The scheduler's view of the tiers. Calls come from the engine thread only. This is
    where the methods' contract is written: the store (``store/planner.py``'s
    ``ChunkPlanner``, bound into ``TieredStore``) implements it."""

    def plan_load(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_device_blocks: int,
        max_blocks: int,
        num_prompt_tokens: int,
    ) -> LoadPlan | None:
        """How much of the stored continuation of a device prefix hit to load (no reads).

        Args:
            block_hashes: the prompt's full-block chain hashes (at least ``max_blocks``).
            num_device_blocks: leading blocks already in the device pool.
            max_blocks: most blocks a hit may cover (the last prompt token is computed).
        Returns None when nothing is worth loading.
        """
        ...

    def plan_span(self, block_hashes: Sequence[BlockHash], start: int, end: int) -> LoadPlan | None:
        """The stored entries holding blocks ``start .. end - 1`` (all of them, or None): a
        hybrid model's other KV groups, once ``plan_load`` chose group 0's load."""
        ...

    def roll_back(self, plan: LoadPlan, num_loaded_blocks: int) -> None:
        """A plan delivered only its first ``num_loaded_blocks`` blocks: forget that the
        chunks after those are stored, so the recomputed blocks are written again."""
        ...

    def plan_writes(
        self,
        block_hashes: Sequence[BlockHash],
        num_full_blocks: int,
        cuts: Sequence[int] = (),
        first_block: int = 0,
    ) -> list[ChunkWrite]:
        """The entries of a finished (or preempted) sequence that the tiers do not hold yet.

        Entries end at every multiple of ``chunk_blocks``, at ``num_full_blocks`` and at each
        of ``cuts`` (block counts where another request is likely to stop sharing this
        sequence: where its device prefix hit ended, where its prompt ended); they start at
        ``first_block`` (a windowed KV group holds no blocks before its window)."""
        ...

    def plan_keeps(
        self,
        block_hashes: Sequence[BlockHash],
        num_full_blocks: int,
        cuts: Sequence[int] = (),
        first_block: int = 0,
    ) -> list[ChunkWrite]:
        """The entries ``plan_writes`` would cut the same sequence into that the tiers are
        known to hold already (call it first: ``plan_writes`` remembers its own as held)."""
        ...

    def keep(self, chunks: Sequence[ChunkWrite], ttl_s: float, owner: str | None) -> None:
        """Keep those held entries at least ``ttl_s`` from now, on ``owner``'s (the
        tenant's) account, in every tier that can: a hit refreshes a breakpoint's or a
        retention's TTL in the tiers as in the pool. Queued: no I/O on the caller's
        thread."""
        ...
