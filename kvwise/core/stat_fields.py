"""Stats dataclasses name their own metrics: each field that is exposed says, in its
``metadata``, the series it is (``metric`` name, ``help`` text, ``kind``: "counter" | "gauge",
and optional fixed ``labels``). Readers (``/metrics``, the dashboard) list the fields with
``metric_fields`` instead of keeping lists of their own, so a new counter is one field.
Pure Python.

A counter's ``metric`` has no ``_total``: Prometheus exposition appends it. Fields that share
a ``metric`` are one series family told apart by their ``labels`` (e.g. the store's load and
recompute decisions). Fields without a metric (nested stats, plain bookkeeping) are not
listed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

COUNTER = "counter"
GAUGE = "gauge"


def metric(
    name: str,
    help_text: str,
    kind: str = COUNTER,
    *,
    default: Any = dataclasses.MISSING,
    labels: dict[str, str] | None = None,
) -> Any:
    """A dataclass field exposed as the series ``name`` (no default unless given: a field
    without one stays positional)."""
    if kind not in (COUNTER, GAUGE):
        raise ValueError(f"kind: expected {COUNTER!r} or {GAUGE!r}, got {kind!r}")
    metadata = {"metric": name, "help": help_text, "kind": kind, "labels": dict(labels or {})}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class MetricField:
    """One field of a stats dataclass and the series it is exposed as."""

    attr: str  # the dataclass field: ``getattr(stats, attr)`` is the value
    metric: str
    help: str
    kind: str  # COUNTER | GAUGE
    labels: tuple[tuple[str, str], ...] = ()  # fixed labels, in order: (name, value)


@functools.cache
def metric_fields(stats_type: type) -> tuple[MetricField, ...]:
    """The fields of the stats dataclass ``stats_type`` that name a metric, in declaration
    order (pass the class, not an instance)."""
    return tuple(
        MetricField(
            f.name,
            f.metadata["metric"],
            f.metadata["help"],
            f.metadata["kind"],
            tuple(f.metadata.get("labels", {}).items()),
        )
        for f in dataclasses.fields(stats_type)
        if "metric" in f.metadata
    )
