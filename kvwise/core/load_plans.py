"""What a waiting request loads from the tiers below the pool: the stored continuation of its
device prefix hit, one plan per KV group (moved out of ``core/scheduler.py``, which keeps the
plans and decides when to ask). Pure Python."""

from __future__ import annotations

from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_spec import first_window_block
from kvwise.core.kv_tiers import KVTierPlanner, LoadPlan
from kvwise.core.request import Request

GroupLoad = tuple[int, LoadPlan, int]  # (KV group, its plan, the first block it loads)


def plan_group_loads(
    tiers: KVTierPlanner, kv: KVCacheManager, request: Request, num_device: int
) -> list[GroupLoad]:
    """The tiers' plan past a device hit of ``num_device`` blocks: a ``(group, plan, first
    block)`` per KV group, group 0's first (its plan chose how far to load); empty when
    nothing is worth loading or a group lacks its part."""
    bs = kv.block_size
    max_blocks = (request.num_tokens - 1) // bs
    if request.hit_limit_blocks is not None:  # a breakpoint's keep ran out there: recomputed
        max_blocks = min(max_blocks, request.hit_limit_blocks)
        if max_blocks <= num_device:
            return []
    window = kv.windows[0]
    first = max(num_device, first_window_block(window, bs, max_blocks * bs))
    plan = tiers.plan_load(
        request.request_id, request.block_hashes, first, max_blocks, request.num_tokens
    )
    if plan is None:
        return []
    end = first + plan.num_blocks
    if first > num_device and first_window_block(window, bs, end * bs) < first:
        return []  # it stopped short of where its window needs the loaded blocks
    loads = [(0, plan, first)]
    for g in range(1, kv.num_groups):
        lo = max(num_device, first_window_block(kv.windows[g], bs, end * bs))
        span = tiers.plan_span(kv.group_hashes(request, g), lo, end)
        if span is None:
            return []  # a group lacks its part: recompute rather than load half
        loads.append((g, span, lo))
    return loads
