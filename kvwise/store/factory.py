"""Build the tiered KV store an engine's ``StoreConfig`` asks for: the tiers the config turns
on, in the registry's order (``store/registry.py``), over entries of this engine's KV layout
and model.

``check_store_config`` refuses, before anything is built (the CLI calls it before the model
loads), a weak store secret and a disk tier path it cannot use, with a ``ValueError`` naming
the option. The secret rule is ``config.check_secret_strength`` (at least 32 characters, at
least 10 of them different, and at least 64 when it is all hex digits: 32 bytes once
decoded); ``StoreConfig`` applies it to ``kv_store_secret``, this module to
``$KVWISE_KV_SECRET`` too.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kvwise.config import StoreConfig, check_secret_strength  # the rule: named here for the CLI
from kvwise.core.kv_spec import KVSpec
from kvwise.store.base import HasLoadPrior, KeepsLocalSecret, KVStore, SharedTier
from kvwise.store.costmodel import CostModel
from kvwise.store.disk_files import SECRET_NAME
from kvwise.store.registry import build_tiers
from kvwise.store.serde import EntryFormat
from kvwise.store.tiered import TieredStore

logger = logging.getLogger("kvwise")

SECRET_ENV = "KVWISE_KV_SECRET"


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
    check_store_config(config)
    try:
        tiers = build_tiers(config)
    except OSError as e:  # what the checks cannot foresee (a race, a read-only file system)
        if config.kv_disk_path is None:
            raise
        raise ValueError(f"kv_disk_path: cannot open the disk tier: {e}") from e
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
        cost_model=CostModel(prefill_chunk_size, load_priors(tiers)),
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


def load_priors(tiers: Sequence[KVStore]) -> dict[str, tuple[float, float, float]]:
    """Where the cost model's read-time fit of each tier starts: the priors the tiers state
    (``HasLoadPrior``); the others start from ``costmodel.DEFAULT_TIER_PRIOR``."""
    return {t.name: t.load_prior for t in tiers if isinstance(t, HasLoadPrior) and t.load_prior}


def store_secret(config: StoreConfig, tiers: Sequence[KVStore]) -> bytes:
    """The secret entry keys are HMACs under: ``kv_store_secret`` (or ``$KVWISE_KV_SECRET``);
    else, with no shared tier, the disk tier's own (or a fresh one per process: host RAM only).

    Raises:
        ValueError: a shared tier (Redis) without a secret, unless explicitly allowed.
    """
    configured = configured_secret(config)
    if configured:
        check_secret_strength(*configured)
        return hashlib.sha256(b"kvwise.store-secret.v1" + configured[0].encode()).digest()
    if any(isinstance(tier, SharedTier) and tier.shared for tier in tiers):
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
        if isinstance(tier, KeepsLocalSecret):
            try:
                return tier.local_secret()
            except OSError as e:
                raise ValueError(
                    f"kv_disk_path: cannot read or make the disk tier's store secret: {e}"
                ) from e
    return os.urandom(32)  # host RAM only: nothing outlives the process


def configured_secret(config: StoreConfig) -> tuple[str, str] | None:
    """The configured store secret and where it came from (``kv_store_secret``, else
    ``$KVWISE_KV_SECRET``), or None."""
    if config.kv_store_secret:
        return config.kv_store_secret, "kv_store_secret"
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV], f"kv_store_secret (${SECRET_ENV})"
    return None


def check_store_config(config: StoreConfig) -> None:
    """What can be checked before a tier is built: the configured secret's strength and the
    disk tier's directory. ValueError naming the option."""
    configured = configured_secret(config)
    if configured:
        check_secret_strength(*configured)
    if config.kv_disk_path is not None:
        check_disk_path(config.kv_disk_path)


def check_disk_path(path: str) -> None:
    """ValueError (naming ``kv_disk_path``) unless the disk tier can use ``path``: a directory
    it can read and write (or create), whose store secret file, if there, is a readable file."""
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"kv_disk_path: '{path}' is not a directory")
    if not root.exists():
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"kv_disk_path: cannot create '{path}': '{parent}' is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"kv_disk_path: cannot create '{path}': '{parent}' is not writable")
        return
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise ValueError(f"kv_disk_path: '{path}' is not a directory this user can read and write")
    secret = root / SECRET_NAME
    if secret.is_symlink() or secret.exists():
        if not secret.is_file():
            raise ValueError(
                f"kv_disk_path: the disk tier's store secret '{secret}' is not a regular file"
            )
        try:
            with open(secret, "rb"):
                pass
        except OSError as e:
            raise ValueError(
                f"kv_disk_path: cannot read the disk tier's store secret '{secret}': {e.strerror}"
            ) from e
