"""int4 KV staging across a preemption: the core reports a block freed while it schedules a step
(a preempted request's open block) with the next step, after it may have handed the block to
another request whose first row is already staged there. That late release must not take the
new owner's staging slot (it raised "rows from offset 1 were written, but its first rows never
were" on the new owner's next row)."""

from __future__ import annotations

import torch

from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import PagedKVCache

BS, KV_HEADS, DIM = 4, 2, 8
SPEC = KVSpec(1, KV_HEADS, DIM, BS, "int4", group_size=4)
BLOCK = 2  # the block that changes hands: slots 8..11


def _write(cache: PagedKVCache, slot: int, row: torch.Tensor, released=()) -> None:
    cache.begin_step(list(released))
    cache.write(0, torch.tensor([slot]), row.unsqueeze(0), row.unsqueeze(0))


def test_a_late_release_of_a_reopened_block_keeps_its_new_rows():
    rows = torch.randn(4, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0))
    cache = PagedKVCache(SPEC, 8)
    _write(cache, BLOCK * BS, rows[0])  # request A opens the block
    _write(cache, BLOCK * BS, rows[1])  # A preempted while this step was scheduled; B opens it
    _write(cache, BLOCK * BS + 1, rows[2], released=[BLOCK])  # A's release, one step late
    assert torch.equal(cache.open_keys(0, BLOCK, 2), rows[1:3])
    # B's own release later frees the slot
    _write(cache, 5 * BS, rows[3], released=[BLOCK])
    assert BLOCK not in cache._slots


def test_a_release_reported_twice_after_a_reopen_frees_the_slot():
    """A freed the block while the step was scheduled, B opened it and finished in that step:
    both releases arrive together, and the slot goes."""
    rows = torch.randn(2, KV_HEADS, DIM, generator=torch.Generator().manual_seed(1))
    cache = PagedKVCache(SPEC, 8)
    _write(cache, BLOCK * BS, rows[0])
    _write(cache, BLOCK * BS, rows[1])
    cache.begin_step([BLOCK, BLOCK])
    assert BLOCK not in cache._slots
    assert len(cache._free_slots) == cache.staged.shape[1]
