"""Build the tiered KV store an engine's ``StoreConfig`` asks for: the tiers the config turns
on, in the registry's order (``store/registry.py``), over entries of this engine's KV layout
and model."""

from __future__ import annotations

import logging

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
    fmt = EntryFormat(
        spec, model_fingerprint, layer_groups=min(config.kv_layer_groups, spec.num_layers)
    )
    tiers = build_tiers(config)
    if not tiers:
        return None
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
