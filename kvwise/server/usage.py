"""A bill per tenant: ``GET /v1/usage?tenant=…&since=…`` (admin only), each tenant's tokens
by kind from the server's ledger (``ledger.py``) and, with a price sheet
(``price_sheet.py``, ``--price-sheet``), their cost and what caching saved.

Access: the dashboard's (``dashboard.AdminGate``): the admin key as ``Authorization: Bearer``;
401 without it or with a wrong one, 403 for a tenant's API key (a tenant never sees another's
bill, nor its own here), 403 when API keys are set and no admin key is; open when neither is.

Query: ``tenant`` (one tenant's row, zeros if it has none; absent: every tenant), ``since``
(an ISO 8601 time, UTC unless it names an offset, or unix seconds; absent: since the server
started): counted from the start of the minute holding it, over at most the last 24 h (older:
a 400 naming ``since``, unless the server is younger than that).

Answer::

    {"object": "usage", "since": 1765100000, "until": 1765103600.5, "bucket_s": 60,
     "retention_s": 86400, "price_sheet": {"currency": "USD", "input": 3.0, ...} | null,
     "tenants": [{"tenant": "alice",
                  "tokens": {"input", "cache_read", "cache_write_5m", "cache_write_1h",
                             "output", "prompt", "sequences"},
                  "cost": {"input", ..., "output", "total"}, "saved": 0.12}]}

(``cost`` and ``saved`` only with a price sheet.)
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from fastapi import FastAPI

from kvwise.server.generation import ServerContext
from kvwise.server.price_sheet import priced_rows
from kvwise.server.protocol import APIError


def parse_since(text: str | None) -> float | None:
    """Unix seconds from an ISO 8601 time (UTC unless it says) or unix seconds; 400 naming
    ``since`` for anything else."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text.strip())
        except ValueError:
            when = None
        if when is None:
            raise APIError(
                400,
                f"since: expected an ISO 8601 time (2026-01-31T12:00:00Z) or unix seconds, "
                f"got {text[:64]!r}",
                param="since",
            ) from None
        value = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(value) or value < 0:
        raise APIError(400, f"since: expected a time after 1970, got {text[:64]!r}", param="since")
    return value


def add_routes(app: FastAPI, context: ServerContext) -> None:
    """Register ``GET /v1/usage`` (guarded by ``dashboard.AdminGate``)."""
    ledger = context.gen.metrics.ledger

    @app.get("/v1/usage", include_in_schema=False)
    async def usage(tenant: str | None = None, since: str | None = None) -> dict:
        if tenant is not None and not 0 < len(tenant) <= 256:
            raise APIError(400, "tenant: expected a name of 1 to 256 characters", param="tenant")
        since_s = parse_since(since)
        try:
            start = ledger.start_of(since_s)
            bills = ledger.bills(tenant, since_s)
        except ValueError as exc:
            raise APIError(400, str(exc), param="since") from None
        sheet = context.price_sheet
        return {
            "object": "usage",
            "since": start,
            "until": ledger.clock(),
            "bucket_s": ledger.bucket_s,
            "retention_s": ledger.retention_s,
            "price_sheet": sheet.as_dict() if sheet is not None else None,
            "tenants": priced_rows(bills, sheet),
        }
