"""What the scheduler needs from the tiers below the device pool, as a protocol. Pure Python.

The scheduler plans; the tiers (``kvwise.store.TieredStore`` implements ``KVTierPlanner``) do
the I/O. At admission the scheduler asks ``plan_load`` how much of a device prefix hit's
continuation to load (a ``LoadPlan``: nothing is read yet); when the step's loads come up
short it calls ``roll_back``; when a request leaves the pool, ``plan_writes`` says which of its
chunks the tiers lack. The plan types are plain data the scheduler owns and hands to the
worker boundary (``core/outputs.py``).

A *chunk* is ``chunk_blocks`` consecutive blocks of a sequence, aligned at multiples of it;
it is the unit the tiers store and load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvwise.core.hashing import BlockHash


@dataclass(frozen=True)
class PlannedChunk:
    """Part of one stored chunk to load into fresh device blocks."""

    first_block: int  # sequence index of the chunk's first block
    skip: int  # leading blocks of the chunk not to load (already on the device)
    num_blocks: int  # blocks to load after those
    block_hashes: tuple[BlockHash, ...]  # the prompt's hashes of blocks first .. first+skip+n
    tiers: tuple[str, ...]  # the tier each layer group is read from


@dataclass(frozen=True)
class LoadPlan:
    """Blocks to load after a request's device prefix hit, chunk by chunk."""

    num_blocks: int  # blocks to load after the device prefix
    chunks: list[PlannedChunk]


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk of a sequence leaving the pool that the tiers should store."""

    first_block: int
    block_hashes: tuple[BlockHash, ...]
    num_tiers: int | None = None  # write to the first this many tiers (None: all)

    @property
    def key(self) -> BlockHash:
        return self.block_hashes[0]


class KVTierPlanner(Protocol):
    """The scheduler's view of the tiers. Calls come from the engine thread only."""

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

    def roll_back(self, plan: LoadPlan, num_loaded_blocks: int) -> None:
        """A plan delivered only its first ``num_loaded_blocks`` blocks: forget that the
        chunks after those are stored, so the recomputed blocks are written again."""
        ...

    def plan_writes(
        self, block_hashes: Sequence[BlockHash], num_full_blocks: int
    ) -> list[ChunkWrite]:
        """The chunks of a finished (or preempted) sequence that the tiers do not hold yet."""
        ...
