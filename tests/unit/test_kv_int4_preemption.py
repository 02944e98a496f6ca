"""int4 KV staging across a preemption: the core reports a block freed while it schedules a step
(a preempted request's open block) with the next step, after it may have handed the block to
another request whose first row is already staged there. That late release must not take the
new owner's staging slot (it raised "rows from offset 1 were written, but its first rows never
were" on the new owner's next row).

The bookkeeping is ``StagingSlots`` (plain Python): tested alone first, then through the int4
pool's tensors."""

from __future__ import annotations

import pytest
import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import Int4KVCache, make_kv_cache
from kvwise.worker.kv_cache.staging import StagingSlots

BS, KV_HEADS, DIM = 4, 2, 8
SPEC = KVSpec(1, KV_HEADS, DIM, BS, "int4", group_size=4)
BLOCK = 2  # the block that changes hands: slots 8..11


def test_a_step_plan_stages_open_blocks_and_seals_full_ones():
    staging = StagingSlots(BS, num_slots=2)
    # block 0 whole (sealed at once), block 1's first 3 rows, block 5's first row
    plan = staging.plan([0, 1, 2, 3, 4, 5, 6, 20])
    assert plan.direct_rows == [0, 1, 2, 3] and plan.seal_blocks == [0]
    assert plan.stage_rows == [4, 5, 6, 7]
    assert plan.stage_dst == [0, 1, 2, 4]  # block 1 in slot 0, block 5 in slot 1
    assert plan.stage_index == [-1, -1, -1, -1, 0, 1, 2, 4]
    assert plan.row_slots == [-1, -1, -1, -1, 0, 0, 0, 1]
    assert staging.open_blocks == {1, 5} and staging.num_free == 0
    staging.release()
    # block 1's last row seals it from its slot; block 3 opens: the area doubles
    plan = staging.plan([7, 12])
    assert plan.seal_slots == [0] and plan.seal_blocks == [1] and plan.row_slots == [0, 2]
    assert staging.num_slots == 4 and staging.open_blocks == {1, 3, 5}
    staging.release()  # the sealed block's slot goes a step later
    assert staging.open_blocks == {3, 5} and staging.num_free == 2
    staging.release([3, 5])  # the core freed them
    assert staging.open_blocks == set() and staging.num_free == staging.num_slots


def test_rows_past_an_unwritten_first_row_are_refused():
    with pytest.raises(RuntimeError, match="first rows never were"):
        StagingSlots(BS).plan([9])


def test_a_late_release_skips_a_block_reopened_in_the_last_step():
    staging = StagingSlots(BS)
    staging.plan([BLOCK * BS])  # A opens the block
    staging.release()
    staging.plan([BLOCK * BS])  # A preempted while this step was scheduled; B opens it
    staging.release([BLOCK])  # A's release, a step late: skipped
    slot = staging.slot_of(BLOCK)
    assert staging.plan([BLOCK * BS + 1]).stage_dst == [slot * BS + 1]
    staging.release([BLOCK])  # B's own
    assert BLOCK not in staging.open_blocks


def _write(cache: Int4KVCache, slot: int, row: torch.Tensor, released=()) -> None:
    slots = torch.tensor([slot])
    cache.begin_step(list(released), slots)
    cache.write(0, slots, row.unsqueeze(0), row.unsqueeze(0))


def test_a_late_release_of_a_reopened_block_keeps_its_new_rows():
    rows = torch.randn(4, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0))
    cache = make_kv_cache(SPEC, 8)
    _write(cache, BLOCK * BS, rows[0])  # request A opens the block
    _write(cache, BLOCK * BS, rows[1])  # A preempted while this step was scheduled; B opens it
    _write(cache, BLOCK * BS + 1, rows[2], released=[BLOCK])  # A's release, one step late
    assert torch.equal(cache.open_keys(0, BLOCK, 2), rows[1:3])
    # B's own release later frees the slot
    _write(cache, 5 * BS, rows[3], released=[BLOCK])
    assert BLOCK not in cache.staging.open_blocks


def test_a_release_reported_twice_after_a_reopen_frees_the_slot():
    """A freed the block while the step was scheduled, B opened it and finished in that step:
    both releases arrive together, and the slot goes."""
    rows = torch.randn(2, KV_HEADS, DIM, generator=torch.Generator().manual_seed(1))
    cache = make_kv_cache(SPEC, 8)
    _write(cache, BLOCK * BS, rows[0])
    _write(cache, BLOCK * BS, rows[1])
    cache.begin_step([BLOCK, BLOCK])
    assert BLOCK not in cache.staging.open_blocks
    assert cache.staging.num_free == cache.staging.num_slots == cache.staged.shape[1]


def test_a_write_the_step_did_not_plan_is_refused():
    cache = make_kv_cache(SPEC, 8)
    cache.begin_step()  # no slots: a step with no rows
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.write(
            0, torch.tensor([0]), torch.zeros(1, KV_HEADS, DIM), torch.zeros(1, KV_HEADS, DIM)
        )
