"""The device pool's figures (``KVCacheManager.stats``), each field naming its metric."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvwise.core.stat_fields import GAUGE, metric


@dataclass(frozen=True)
class KVCacheStats:
    """The device pool at one moment; token counts are totals since start. Each field names
    its metric (``core.stat_fields``)."""

    blocks_total: int = metric("kvwise_kv_blocks_total", "KV blocks in the pool", GAUGE)
    blocks_used: int = metric("kvwise_kv_blocks_used", "KV blocks held by requests", GAUGE)
    blocks_cached_free: int = metric(  # free, still holding a reusable cached prefix
        "kvwise_kv_blocks_cached", "free KV blocks still holding a cached prefix", GAUGE
    )
    blocks_free: int = metric("kvwise_kv_blocks_free", "free KV blocks", GAUGE)
    blocks_kept: int = metric(
        "kvwise_kv_blocks_kept", "KV blocks kept by retention (used or free)", GAUGE
    )
    prefix_query_tokens: int = metric(
        "kvwise_prefix_cache_queries_tokens", "prompt tokens looked up in the prefix cache"
    )
    prefix_hit_tokens: int = metric(
        "kvwise_prefix_cache_hits_tokens", "prompt tokens found in the prefix cache"
    )
    utilization: float = metric(  # tokens held by running sequences / capacity of their blocks
        "kvwise_kv_utilization", "share of allocated KV slots holding computed tokens", GAUGE
    )
    breakpoint_expiries: int = metric(  # the prefix is then created again (core/breakpoints)
        "kvwise_cache_breakpoint_expiries",
        "lookups that found a cache breakpoint's keep run out",
        default=0,
    )

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )


def kv_utilization(
    requests: Iterable, tables: Mapping[str, Sequence[Sequence[object]]], null: object, bs: int
) -> float:
    """Tokens held by live sequences / token capacity of the blocks they hold (``tables``:
    each request id's block tables; ``null``: the null block, which holds nothing)."""
    held = capacity = 0
    for request in requests:
        for blocks in tables.get(request.request_id, ()):
            num_null = sum(1 for b in blocks if b is null)
            capacity += (len(blocks) - num_null) * bs
            held += max(0, min(request.num_computed_tokens, len(blocks) * bs) - num_null * bs)
    return held / capacity if capacity else 1.0
