"""The live dashboard of one server: ``GET /dashboard`` (a page and its script, shipped in
``kvwise/server/static/``: charts are inline SVG drawn by plain JavaScript, nothing is fetched
from elsewhere) and ``GET /dashboard/data`` (JSON), which the page polls every ``interval_s``.

What it shows: generated tokens/s and TTFT (p50, p99, mean) over time, KV pool occupancy,
the prefix hit rate of the device pool and of each tier (the share of prompt tokens looked up
that each one served), the cost model's load-vs-recompute decisions, its current fit as
predicted TTFT against prefix length per tier and for recomputing (each tier's break-even
marked), the waiting queue, running requests and 429s, a row per tier, a row per tenant
(requests, prompt, generated and cached tokens: ``ServerMetrics.tenants``, the busiest
``max_tenants`` by name and one row for the rest), and the bill per tenant (``bill``: tokens
by kind since start and, with a price sheet, their cost and what caching saved, as
``GET /v1/usage`` answers).

Samples (``dashboard_series.py``): a task of the app samples the engine's stats and the
request totals every ``interval_s`` (and a data request does when the last sample is older),
into a ring buffer of the last ``max_samples``, so a page opened late still sees the last
minutes; hit rates and TTFT are over a sliding window of ``window`` samples, tokens/s per
interval (and over the window). A sample holds every field the stats dataclasses name a
metric for (``core.stat_fields``; JSON key: the field's name without ``num_``), and the JSON's
``now``, ``tiers`` and ``tenants`` carry them all, so a new stats field reaches the page's data
with no edit here; the charts pick theirs by that key.

Access (``AdminGate``): without API keys and without an admin key the dashboard is open, like
/metrics. Otherwise it needs the admin key (``--admin-key`` / ``$KVWISE_ADMIN_KEY``), sent as
``Authorization: Bearer KEY``, or once as ``/dashboard?key=KEY``: that answers with a redirect
to ``/dashboard`` and an HttpOnly, SameSite=Strict cookie (an HMAC of the key, never the key),
which the browser then sends with the page's data requests. The key is taken out of the query
string before the access log sees it. Missing or wrong key: 401; a tenant's API key: 403;
API keys set but no admin key: 403 (the dashboard is off). The same gate guards
``GET /v1/usage`` (``usage.py``), and tells /metrics whether the scrape may see the per-tenant
series (the admin key as Bearer, or an open server).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.resources
import time
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvwise.engine.client import EngineClient
from kvwise.server.dashboard_series import (
    DashboardHistory,
    Sample,
    finite,
    stat_values,
    take_sample,
)
from kvwise.server.metrics import ServerMetrics
from kvwise.server.price_sheet import PriceSheet, priced_rows
from kvwise.server.protocol import APIError
from kvwise.server.request_stats import OTHER_TENANTS, TenantCounts
from kvwise.server.transport import ADMIN_PATHS
from kvwise.store.stats import TierStats

COOKIE = "kvwise_dashboard"
_COOKIE_TAG = b"kvwise.dashboard.v1"
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # the page runs only its own script: no inline script, nothing from another origin
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
}


# ---- the data endpoint ----------------------------------------------------------------------


class Dashboard:
    """The dashboard's routes over one async engine and the server's metrics."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        model_name: str,
        interval_s: float = 2.0,
        price_sheet: PriceSheet | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.price_sheet = price_sheet  # prices the bill per tenant (None: tokens only)
        self.history = DashboardHistory(self._read, interval_s)
        static = importlib.resources.files("kvwise.server") / "static"
        self._page = (static / "dashboard.html").read_bytes()
        self._script = (static / "dashboard.js").read_bytes()

    def _read(self) -> Sample:
        return take_sample(
            self.engine.stats(), self.metrics.totals(), self.engine.is_running, time.time()
        )

    def data(self) -> dict:
        """Everything the page draws, JSON-ready: the counters as of now, the series as of
        the last sample."""
        self.history.sample()
        series = self.history.series()
        newest = self._read()
        stats = newest.stats
        queried = stats["prefix_query_tokens"]
        hit_rate = {
            "device pool": _ratio(stats["prefix_hit_tokens"], queried),
            **{tier: _ratio(n, queried) for tier, n in newest.tier_loaded_tokens.items()},
        }

        def last(key: str):  # the newest point of a series (None before any sample)
            return series[key][-1] if series.get(key) else None

        return {
            "model": self.model_name,
            "time": newest.t,
            "interval_s": self.history.interval_s,
            "window_s": self.history.interval_s * self.history.window,
            "engine_up": newest.engine_up,
            "now": {
                **stats,  # every stats field, by its key
                "blocks_cached": stats["blocks_cached_free"],  # the series' name
                "rejected_429": newest.rejected_429,
                "requests_finished": newest.requests_finished,
                "hit_rate": hit_rate,  # since start
                # over the window
                "ttft_mean_s": last("ttft_mean_s"),
                "ttft_p50_s": last("ttft_p50_s"),
                "ttft_p99_s": last("ttft_p99_s"),
                "tokens_per_s": last("tokens_per_s_window"),
            },
            "series": series,
            "tiers": self._tiers(),
            "tenants": self._tenants(),
            "bill": self._bill(),
            "cost_model": self._cost_model(),
        }

    def _tiers(self) -> list[dict]:
        """A row per tier: every ``TierStats`` field (``stat_values``: entries, bytes, hits,
        misses, faults, loads, load_seconds, loaded_tokens, errors by operation, breaker_open,
        ...) and ``degraded``: why the tier is degraded ("" when it is not)."""
        store = self.engine.stats().store
        tiers = store.tiers.items() if store is not None else ()
        return [
            {"name": name, **stat_values(t, TierStats), "degraded": t.degraded} for name, t in tiers
        ]

    def _tenants(self) -> list[dict]:
        """A row per tenant, most requests first, every ``TenantCounts`` field by its key
        (requests, prompt_tokens, generated_tokens, cached_tokens); the tenants without a row
        of their own (``max_tenants``) last, as ``OTHER_TENANTS`` with ``other`` true."""
        return [
            {"name": name, "other": name == OTHER_TENANTS, **stat_values(counts, TenantCounts)}
            for name, counts in self.metrics.tenants.rows()
        ]

    def _bill(self) -> dict:
        """Each tenant's tokens by kind since start (``ledger.py``) and, priced, their cost and
        what caching saved: ``/v1/usage``'s rows."""
        sheet = self.price_sheet
        rows = priced_rows(self.metrics.ledger.bills(), sheet)
        return {"currency": sheet.currency if sheet else None, "tenants": rows}

    def _cost_model(self) -> dict | None:
        curves = self.engine.cost_curves()
        if curves is None:
            return None
        return {
            "policy": curves.policy,
            "prefix_tokens": list(curves.prefix_tokens),
            "recompute_ttft_s": finite(curves.recompute_ttft_s),
            "step_observations": curves.num_step_observations,
            "tiers": [
                {
                    "name": c.tier,
                    "ttft_s": finite(c.ttft_s),
                    "break_even_tokens": c.break_even_tokens,
                    "observations": c.num_observations,
                }
                for c in curves.tiers
            ],
        }

    # ---- routes -------------------------------------------------------------------------

    async def page(self) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def script(self) -> Response:
        return Response(self._script, media_type="text/javascript; charset=utf-8", headers=_HEADERS)

    async def data_route(self) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(self.data), headers=_HEADERS)

    def add_routes(self, app: FastAPI) -> None:
        app.get("/dashboard", include_in_schema=False)(self.page)
        app.get("/dashboard/dashboard.js", include_in_schema=False)(self.script)
        app.get("/dashboard/data", include_in_schema=False)(self.data_route)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


# ---- access ---------------------------------------------------------------------------------


def check_admin_key(admin_key: str | None, tenant_keys: Iterable[str]) -> str | None:
    """The admin key a server takes (None: none); ValueError when it cannot be one."""
    if admin_key is None:
        return None
    if not admin_key.strip() or admin_key != admin_key.strip():
        raise ValueError("admin_key: must be non-empty, without leading or trailing spaces")
    if any(hmac.compare_digest(admin_key.encode(), k.encode()) for k in tenant_keys):
        raise ValueError("admin_key: must differ from every tenant's API key")
    return admin_key


class AdminGate:
    """ASGI middleware guarding ``/dashboard`` and every path under it (see the module
    docstring): the admin key by Bearer header, ``?key=`` or the cookie it sets."""

    def __init__(self, app, admin_key: str | None, tenant_keys: Iterable[str]) -> None:
        self.app = app
        self.admin_key = admin_key.encode() if admin_key else None
        self.tenant_keys = [k.encode() for k in tenant_keys]
        self.open = self.admin_key is None and not self.tenant_keys
        self.cookie = (
            hmac.new(self.admin_key, _COOKIE_TAG, hashlib.sha256).hexdigest()
            if self.admin_key
            else None
        )

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path == "/metrics":  # open; the bill per tenant: admin
            headers = dict(scope.get("headers") or [])
            admin = self.open or self.check(headers.get(b"authorization"), None, None) is None
            scope.setdefault("state", {})["admin"] = admin
        if scope["type"] != "http" or not _guarded(path):
            await self.app(scope, receive, send)
            return
        what = path if path in ADMIN_PATHS else "dashboard"  # what the errors name
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), True)
        query_key = next((v for k, v in query if k == "key"), None)
        if query_key is not None:  # NOTE: in place: uvicorn logs this scope's query string
            scope["query_string"] = urlencode([(k, v) for k, v in query if k != "key"]).encode()
        if self.open:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        error = self.check(
            headers.get(b"authorization"), query_key, headers.get(b"cookie"), what=what
        )
        if error is not None:
            headers_out = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else {}
            response = JSONResponse(
                error.body(),
                status_code=error.status_code,
                headers={**headers_out, "Cache-Control": "no-store"},
            )
            await response(scope, receive, send)
            return
        if query_key is not None and path == "/dashboard" and scope.get("method") == "GET":
            # swap the key in the address bar (and the history) for the cookie
            response = Response(status_code=303, headers={"Location": "/dashboard"})
            response.set_cookie(
                COOKIE, self.cookie, path="/dashboard", httponly=True, samesite="strict"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def check(
        self,
        authorization: bytes | None,
        query_key: str | None,
        cookie_header: bytes | None,
        what: str = "dashboard",
    ) -> APIError | None:
        """None when the request may see the dashboard (or ``what``: the usage route),
        else the error to answer with. The first credential given decides: Bearer header,
        then ``?key=``, then the cookie."""
        if self.admin_key is None:
            return APIError(
                403,
                f"{what}: off, because API keys are set and no admin key is: start the "
                "server with --admin-key KEY (or $KVWISE_ADMIN_KEY)",
                code="dashboard_disabled",
                error_type="permission_error",
            )
        presented: bytes | None = None
        if authorization:
            scheme, _, token = authorization.partition(b" ")
            presented = token.strip() if scheme.lower() == b"bearer" else b""
        elif query_key is not None:
            presented = query_key.encode()
        else:
            cookie = _cookie(cookie_header, COOKIE)
            if cookie is not None:
                if hmac.compare_digest(cookie.encode(), self.cookie.encode()):
                    return None
                return _unauthorized(
                    "dashboard: the session cookie is stale: open /dashboard?key=ADMIN_KEY again"
                )
        if presented is None:
            how = "open /dashboard?key=ADMIN_KEY, or send" if what == "dashboard" else "send"
            return _unauthorized(
                f"{what}: needs the admin key: {how} 'Authorization: Bearer ADMIN_KEY'"
            )
        if hmac.compare_digest(presented, self.admin_key):
            return None
        if any(hmac.compare_digest(presented, k) for k in self.tenant_keys):
            return APIError(
                403,
                f"{what}: this is a tenant's API key; it needs the admin key",
                code="not_admin",
                error_type="permission_error",
            )
        return _unauthorized(f"{what}: invalid admin key")


def _guarded(path: str) -> bool:
    """The paths ``AdminGate`` guards: the dashboard's and ``ADMIN_PATHS`` (``usage.py``)."""
    return path == "/dashboard" or path.startswith("/dashboard/") or path in ADMIN_PATHS


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_admin_key")


def _cookie(header: bytes | None, name: str) -> str | None:
    if not header:
        return None
    for part in header.decode("latin-1").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None
