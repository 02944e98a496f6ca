"""int4 staging bookkeeping: which open block has which staging slot. Pure Python, no torch.

int4 keys are quantized per channel over a whole block, so a block's keys are written when it
is full ("sealed"). Until then its rows wait in full precision in a staging slot, one slot per
open block (the tensors are ``Int4KVCache.staged``; this class only decides places):

- ``plan(slots)``, once per step: where the step's rows go. A block written whole in the step
  is sealed from the rows at once; rows of an open block go to its slot (a block's first row
  takes a free slot, growing the area by doubling when none is free); a block the step
  completes is sealed from its slot.
- ``release(released_block_ids)``, before the next plan: a block sealed in the last step frees
  its slot (that step's attention still read it), and so does an open block the core freed.

NOTE: the core reports a block freed while it schedules a step (a preempted request's) with the
NEXT step, and may have handed it to another request in the same step, which then wrote its
first row: a release of a block opened in the last step may be that stale one, so it is
skipped once (a real one only keeps the slot until the block's first row is written again,
which reuses it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlan:
    """One step's int4 writes: row indices (into the step's rows), flat staging places (``slot
    * block_size + offset``), slots and block ids."""

    stage_index: list[int]  # (T,) each row's flat staging place, -1 where it has none
    direct_rows: list[int]  # rows of blocks written whole, block by block
    stage_rows: list[int]  # rows going to staging slots...
    stage_dst: list[int]  # ...at these flat places
    seal_slots: list[int]  # slots of staged blocks this step completes
    seal_blocks: list[int]  # blocks sealed: the direct ones, then the staged ones
    row_slots: list[int]  # (T,) each row's own block's slot (-1: a block written whole)


class StagingSlots:
    """Staging slots of open int4 blocks (see the module docstring)."""

    def __init__(self, block_size: int, num_slots: int = 8) -> None:
        self.block_size = block_size
        self.num_slots = num_slots  # the staging area's size (grows by doubling)
        self._slots: dict[int, int] = {}  # open block id -> its staging slot
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._sealed: list[int] = []  # blocks sealed this step: slots freed next step
        self._opened: list[int] = []  # blocks whose first row went to staging this step

    @property
    def open_blocks(self) -> frozenset[int]:
        """The blocks holding a slot now."""
        return frozenset(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, block_id: int) -> int:
        """The staging slot of an open block (KeyError: it has none)."""
        return self._slots[block_id]

    def release(self, released_block_ids: Iterable[int] = ()) -> None:
        """Before a step: free the slots of blocks sealed in the last step and of blocks the
        core freed since (a late release of a block reopened in the last step skipped once)."""
        stale = Counter(self._opened)
        for block_id in released_block_ids:
            if stale[block_id]:
                stale[block_id] -= 1
                continue
            self._release(block_id)
        for block_id in self._sealed:
            self._release(block_id)
        self._sealed = []
        self._opened = []

    def _release(self, block_id: int) -> None:
        slot = self._slots.pop(block_id, None)
        if slot is not None:
            self._free.append(slot)

    def plan(self, slots: list[int]) -> StagePlan:
        """Where one step's rows (at pool slots ``slots``) go; takes the slots of the blocks
        they open.

        Raises:
            RuntimeError: rows of a block from past its first offset whose first rows were
                never written (a bug upstream: the core's block table and the worker disagree).
        """
        bs = self.block_size
        direct, stage_rows, stage_dst, seal_slots, seal_direct, seal_staged = [], [], [], [], [], []
        i, n = 0, len(slots)
        while i < n:
            block, first = divmod(slots[i], bs)
            j = i + 1
            while j < n and slots[j] == slots[j - 1] + 1 and slots[j] % bs:
                j += 1
            count = j - i
            full = first + count == bs
            if first == 0 and full:
                direct.extend(range(i, j))
                seal_direct.append(block)
            else:
                slot = self._slot_for(block, first)
                stage_rows.extend(range(i, j))
                stage_dst.extend(range(slot * bs + first, slot * bs + first + count))
                if full:
                    seal_slots.append(slot)
                    seal_staged.append(block)
            if full:
                self._sealed.append(block)
            i = j
        stage_index = [-1] * n
        for row, dst in zip(stage_rows, stage_dst, strict=True):
            stage_index[row] = dst
        return StagePlan(
            stage_index=stage_index,
            direct_rows=direct,
            stage_rows=stage_rows,
            stage_dst=stage_dst,
            seal_slots=seal_slots,
            seal_blocks=seal_direct + seal_staged,
            row_slots=[place // bs for place in stage_index],  # -1 // bs == -1
        )

    def _slot_for(self, block: int, first: int) -> int:
        """The slot of a block whose rows from offset ``first`` are staged now."""
        if first == 0:  # the block's first row: it (re)opens
            self._opened.append(block)
            slot = self._slots.get(block)
            if slot is None:
                slot = self._slots[block] = self._take()
            return slot
        slot = self._slots.get(block)
        if slot is None:
            raise RuntimeError(
                f"block {block}: rows from offset {first} were written, but its first rows "
                f"never were"
            )
        return slot

    def _take(self) -> int:
        if not self._free:  # grow the staging area (doubling)
            old = self.num_slots
            self.num_slots = 2 * old
            self._free = list(range(self.num_slots - 1, old - 1, -1))
        return self._free.pop()
