"""Build the tiered KV store an engine's ``StoreConfig`` asks for (host → disk → redis)."""

from __future__ import annotations

import logging

from kvwise.config import StoreConfig
from kvwise.store.costmodel import CostModel
from kvwise.store.serde import EntryFormat
from kvwise.store.tiered import TieredStore
from kvwise.utils import format_bytes

logger = logging.getLogger("kvwise")


def build_store(
    config: StoreConfig,
    model_fingerprint: str,
    dtype: str,
    arch,
    block_size: int,
    prefill_chunk_size: int | None,
) -> TieredStore:
    tiers = []
    if config.kv_host_memory:
        from kvwise.store.host import HostStore

        tiers.append(HostStore(config.kv_host_memory))
    if config.kv_disk_path:
        from kvwise.store.disk import DiskStore

        tiers.append(DiskStore(config.kv_disk_path, config.kv_disk_size))
    if config.kv_redis_url:
        from kvwise.store.redis import RedisStore

        tiers.append(
            RedisStore(
                config.kv_redis_url, ttl_s=config.kv_redis_ttl, timeout_s=config.kv_redis_timeout
            )
        )
    fmt = EntryFormat(
        model_fingerprint,
        dtype,
        arch.num_layers,
        block_size,
        arch.num_kv_heads,
        arch.head_dim,
        layer_groups=min(config.kv_layer_groups, arch.num_layers),
    )
    store = TieredStore(
        tiers,
        fmt,
        chunk_blocks=config.kv_chunk_blocks,
        min_tokens=config.kv_store_min_tokens,
        policy=config.kv_load_policy,
        cost_model=CostModel(prefill_chunk_size),
    )
    described = []
    for tier in tiers:
        if tier.name == "host":
            described.append(f"host {format_bytes(config.kv_host_memory)}")
        elif tier.name == "disk":
            described.append(
                f"disk {format_bytes(config.kv_disk_size)} at {config.kv_disk_path} "
                f"({tier.stats.num_entries} entries found)"
            )
        else:
            described.append("redis")
    logger.info(
        "KV tiers: %s; chunks of %d blocks in %d layer groups; sequences under %d tokens "
        "not stored",
        " → ".join(described),
        config.kv_chunk_blocks,
        fmt.layer_groups,
        config.kv_store_min_tokens,
    )
    return store
