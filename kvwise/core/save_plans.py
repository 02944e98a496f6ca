"""What a request leaving the pool (finished or preempted) saves to the tiers below it, and
which of their entries it keeps longer (moved out of ``core/scheduler.py``, which decides
when a request leaves and hands the saves to the worker). Pure Python."""

from __future__ import annotations

from kvwise.core.breakpoints import keep_cuts, keep_stored, save_ttl
from kvwise.core.kv_cache_manager import KVCacheManager
from kvwise.core.kv_tiers import KVTierPlanner
from kvwise.core.outputs import KVSave
from kvwise.core.request import Request


def save_cuts(request: Request, block_size: int) -> tuple[int, ...]:
    """Where ``request``'s stored entries should end: where another request is likely to stop
    sharing it (the end of its device prefix hit, of what it loaded, of its prompt: the
    blocks a repeat of it can load, and all of its full blocks, which its next turn shares)
    and at each of its cache breakpoints' keep runs (each entry in one run: its TTL)."""
    bs = block_size
    cached = max(request.num_cached_tokens, 0)
    return (
        (cached - request.num_loaded_tokens) // bs,
        cached // bs,
        (request.num_prompt_tokens - 1) // bs,
        request.num_prompt_tokens // bs,
        *keep_cuts(request),
    )


def plan_saves(
    tiers: KVTierPlanner,
    kv: KVCacheManager,
    request: Request,
    windowed_only: bool = False,
    soon: bool = False,
) -> list[KVSave]:
    """The full computed blocks of ``request`` the tiers lack, as saves: each KV group's
    under its own hashes (a windowed group's from its window on: it holds no blocks
    before), each with its TTL (``breakpoints.save_ttl``) on the tenant's account; the
    entries they hold already are kept again first (``breakpoints.keep_stored``).
    ``windowed_only``: the windowed groups' blocks only, as its prompt is done (they leave
    the window before it finishes; a repeat of the prompt needs those of its end).
    ``soon``: it was preempted and will load them back."""
    bs = kv.block_size
    cuts = save_cuts(request, bs)
    saves = []
    for g, window in enumerate(kv.windows):
        if windowed_only and not window:
            continue
        block_ids = kv.block_ids(request.request_id, g)
        hashes = kv.group_hashes(request, g)
        num_full = min(request.num_computed_tokens // bs, len(hashes), len(block_ids))
        first = kv.first_held(request.request_id, g, num_full)
        keep_stored(tiers, request, hashes, num_full, cuts, first)
        for chunk in tiers.plan_writes(hashes, num_full, cuts, first_block=first):
            end = chunk.first_block + len(chunk.block_hashes)
            ttl_s = save_ttl(request, end)
            saves.append(
                KVSave(block_ids[chunk.first_block : end], chunk, ttl_s, request.tenant, soon)
            )
    return saves
