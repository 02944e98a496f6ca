"""The kinds of KV tier, in order (top first): the one place that lists them.

Each tier module provides ``from_config(config: StoreConfig) -> KVStore | None`` (None: the
config turns that tier off) and its store class a one-line ``describe()`` for the start-up
log; ``build_tiers`` builds every tier the config turns on, in registration order. Nothing
else names a tier kind: the stats, the plans and the log use each tier's ``name``.

``register_tier`` adds a kind below the registered ones (e.g. a test's in-memory fake).
"""

from __future__ import annotations

from collections.abc import Callable

from kvwise.config import StoreConfig
from kvwise.store import disk, host, redis
from kvwise.store.base import KVStore

TierBuilder = Callable[[StoreConfig], KVStore | None]

_TIERS: list[tuple[str, TierBuilder]] = []


def register_tier(name: str, builder: TierBuilder) -> None:
    """Add a tier kind below every one registered so far.

    Raises:
        ValueError: a kind of that name is registered already.
    """
    if name in tier_names():
        raise ValueError(f"tier {name!r}: registered already")
    _TIERS.append((name, builder))


def unregister_tier(name: str) -> None:
    """Remove a kind (tests that registered one). Unknown names are ignored."""
    _TIERS[:] = [(n, b) for n, b in _TIERS if n != name]


def tier_names() -> list[str]:
    """The registered kinds, top first."""
    return [name for name, _ in _TIERS]


def build_tiers(config: StoreConfig) -> list[KVStore]:
    """The tiers ``config`` turns on, top first."""
    tiers = []
    for _, build in _TIERS:
        tier = build(config)
        if tier is not None:
            tiers.append(tier)
    return tiers


register_tier("host", host.from_config)
register_tier("disk", disk.from_config)
register_tier("redis", redis.from_config)
