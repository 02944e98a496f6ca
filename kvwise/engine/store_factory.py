"""Build the tiered KV store an engine's ``StoreConfig`` asks for: the tiers the config turns
on, in the registry's order (``store/registry.py``), over entries of this engine's KV layout
and model."""

from __future__ import annotations

import hashlib
import logging
import os

from kvwise.config import StoreConfig
from kvwise.core.kv_spec import KVSpec
from kvwise.store.costmodel import CostModel
from kvwise.store.registry import build_tiers
from kvwise.store.serde import EntryFormat
from kvwise.store.tiered import TieredStore

logger = logging.getLogger("kvwise")


def build_store(
    config: StoreConfig,
    spec: KVSpec,
    model_fingerprint: str,
    prefill_chunk_size: int | None,
) -> TieredStore | None:
    """The store over every tier ``config`` turns on (None when it turns none on).

    Args:
        spec: the KV layout of the device pool (and so of every stored entry).
        model_fingerprint: goes into every entry's header; entries of another model are
            refused.
        prefill_chunk_size: the scheduler's, for the cost model's recompute estimates.
    """
    tiers = build_tiers(config)
    if not tiers:
        return None
    try:
        secret = store_secret(config, tiers)
    except ValueError:
        for tier in tiers:
            tier.close()
        raise
    fmt = EntryFormat(
        spec,
        model_fingerprint,
        layer_groups=min(config.kv_layer_groups, spec.num_layers),
        secret=secret,
    )
    store = TieredStore(
        tiers,
        fmt,
        chunk_blocks=config.kv_chunk_blocks,
        min_tokens=config.kv_store_min_tokens,
        policy=config.kv_load_policy,
        cost_model=CostModel(
            prefill_chunk_size,
            {t.name: t.load_prior for t in tiers if getattr(t, "load_prior", None)},
        ),
    )
    logger.info(
        "KV tiers: %s; chunks of %d blocks in %d layer groups; sequences under %d tokens "
        "not stored",
        " → ".join(tier.describe() for tier in tiers),
        config.kv_chunk_blocks,
        fmt.layer_groups,
        config.kv_store_min_tokens,
    )
    return store


def store_secret(config: StoreConfig, tiers) -> bytes:
    """The secret entry keys are HMACs under: ``kv_store_secret`` (or ``$KVWISE_KV_SECRET``);
    else, with no shared tier, the disk tier's own (or a fresh one per process: host RAM only).

    Raises:
        ValueError: a shared tier (Redis) without a secret, unless explicitly allowed.
    """
    configured = config.kv_store_secret or os.environ.get("KVWISE_KV_SECRET")
    if configured:
        return hashlib.sha256(b"kvwise.store-secret.v1" + configured.encode()).digest()
    if any(getattr(tier, "shared", False) for tier in tiers):
        if not config.kv_redis_allow_no_secret:
            raise ValueError(
                "kv_store_secret: a shared Redis tier needs a store secret (the same for every "
                "engine sharing it): set KVWISE_KV_SECRET or --kv-store-secret; without one, "
                "anyone with access to Redis can tell which prompts are stored and plant "
                "entries for them (--kv-redis-allow-no-secret accepts that)"
            )
        logger.warning("KV tiers: Redis is shared without a store secret: its keys are predictable")
        return b""
    for tier in tiers:
        local_secret = getattr(tier, "local_secret", None)
        if local_secret is not None:
            return local_secret()
    return os.urandom(32)  # host RAM only: nothing outlives the process
