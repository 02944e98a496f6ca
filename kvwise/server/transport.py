"""HTTP plumbing that runs before a route: ASGI middleware and the values it is built from.
The Host header checked against the allowed hosts (421 otherwise, before anything else:
``HostCheck``), API keys → tenants (401 before the body is read) with each caller's budget of
invalid requests (429 before the body is read) and the request counter by route and status
(``AuthAndCount``), and the body size limit (413: ``BodyLimit``). How answers leave (error
bodies, server-sent events, disconnect watching) is ``responses.py``."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
import time
from collections.abc import Iterable

from starlette.exceptions import HTTPException as StarletteHTTPException

from kvwise.server.dialects import error_response
from kvwise.server.metrics import ServerMetrics
from kvwise.server.protocol import APIError


def parse_api_keys(pairs: Iterable[str] | None = None, env: str | None = None) -> dict[str, str]:
    """API key → tenant from ``KEY=TENANT`` items (``--api-key``, repeatable) and from ``env``
    (the ``KVWISE_API_KEYS`` value, ``k1=alice,k2=bob``). ValueError on a malformed item."""
    items = list(pairs or [])
    if env:
        items += [item for item in env.split(",") if item.strip()]
    keys: dict[str, str] = {}
    for i, item in enumerate(items):
        key, sep, tenant = item.partition("=")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ValueError(f"api_key: item {i + 1} is not KEY=TENANT")
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"api_key: item {i + 1} maps a key already given another tenant")
        keys[key] = tenant
    return keys


# what a server bound to a loopback address answers to by default: a page a browser loaded
# from any other name (DNS rebinding: evil.example resolving to 127.0.0.1) is refused
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def allowed_hosts_for(bind_host: str, given: Iterable[str] | None = None) -> tuple[str, ...] | None:
    """The Host header values a server bound to ``bind_host`` answers to (None: any).

    Args:
        given: ``--allowed-hosts`` items (repeatable, each may be ``a,b``): host names or
            addresses, each with an optional ``:port`` (without one, any port), IPv6 in
            brackets; ``*`` allows any. None or empty: the default, loopback names only
            (``LOOPBACK_HOSTS``) when ``bind_host`` is a loopback address, else any host.

    Raises:
        ValueError: an item that is no host (naming ``allowed_hosts``).
    """
    items = [item.strip() for value in given or () for item in value.split(",")]
    items = [item for item in items if item]
    if not items:
        return LOOPBACK_HOSTS if _is_loopback(bind_host) else None
    return None if parse_allowed_hosts(items) is None else tuple(dict.fromkeys(items))


def parse_allowed_hosts(items: Iterable[str]) -> frozenset[tuple[str, int | None]] | None:
    """Allowed hosts as (lowercase name, port or None: any port); None when ``*`` is one.

    Raises:
        ValueError: an item that is no host (naming ``allowed_hosts``).
    """
    hosts = set()
    for item in items:
        if item.strip() == "*":
            return None
        host = _split_host(item, bare_ipv6=True)
        if host is None:
            raise ValueError(
                f"allowed_hosts: {item!r} is not a host name or address with an optional "
                "':port' (IPv6 in brackets), nor '*'"
            )
        hosts.add(host)
    return frozenset(hosts)


def _is_loopback(bind_host: str) -> bool:
    if bind_host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str, bare_ipv6: bool = False) -> tuple[str, int | None] | None:
    """``name[:port]`` / ``[v6][:port]`` → (lowercase name, port or None); None if malformed.
    ``bare_ipv6``: accept ``::1`` without brackets too (the flag's items, never a header)."""
    value = value.strip().lower()
    if bare_ipv6 and value.count(":") > 1 and not value.startswith("["):
        value = f"[{value}]"
    if value.startswith("["):
        name, bracket, port = value[1:].partition("]")
        try:
            name = f"[{ipaddress.IPv6Address(name)}]"
        except ValueError:
            return None
        if not bracket or (port and not port.startswith(":")):
            return None
        port = port[1:] if port else None
    else:
        name, colon, port = value.partition(":")
        port = port if colon else None
        name = name.rstrip(".")  # "localhost." is localhost
        if not name or any(c in name for c in "/@?#\\ \t*[]"):
            return None
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        return None
    return name, int(port) if port is not None else None


class HostCheck:
    """ASGI middleware: a request whose Host header names no allowed host gets 421
    (Misdirected Request) with an OpenAI error body, before anything else runs: every route,
    /health included. An allowed host without a port matches it on any port."""

    def __init__(self, app, allowed: frozenset[tuple[str, int | None]]) -> None:
        """``allowed``: from ``parse_allowed_hosts``."""
        self.app = app
        self.allowed = allowed

    def allows(self, value: bytes) -> bool:
        split = _split_host(value.decode("latin-1"))
        if split is None:
            return False
        return split in self.allowed or (split[0], None) in self.allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        hosts = [value for name, value in scope.get("headers") or () if name == b"host"]
        if hosts and all(self.allows(value) for value in hosts):
            await self.app(scope, receive, send)
            return
        if hosts:
            shown = hosts[0].decode("latin-1")
            shown = shown if len(shown) <= 100 else shown[:100] + "..."
            message = f"Host header {shown!r}: not a host this server answers to"
        else:
            message = "no Host header: this server answers only to named hosts"
        error = APIError(421, f"{message} (see --allowed-hosts)", code="host_not_allowed")
        await error_response(scope, error)(scope, receive, send)


class InvalidRequestBudget:
    """How many invalid requests a caller may send: a token bucket per caller (the tenant with
    API keys, else the client's address), charged by every 4xx answer it earned (400, 404,
    413, 422, 431: 1 + 1 per MiB of its body), refilled at ``refill_per_s``. A caller whose
    bucket is empty gets a 429 at once, before its body is read, until it refills: a tenant
    flooding the server with bad or huge requests costs it a header parse each, and the other
    tenants' requests go on at their speed (``tests/server/test_isolation.py``). Well-behaved
    callers never see it: it takes ``capacity`` invalid requests in a burst."""

    CHARGED = frozenset({400, 404, 413, 422, 431})
    MAX_CALLERS = 10_000  # buckets remembered; full ones are forgotten first

    def __init__(
        self,
        capacity: float = 20.0,
        refill_per_s: float = 5.0,
        clock=time.monotonic,
        hold_s: float = 1.0,
        max_held: int = 16,
    ):
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self.hold_s = hold_s  # a refusal waits this long before it is sent
        self.max_held = max_held  # refusals of one caller waiting at once
        self._held: dict[str, int] = {}
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, at)
        self.num_refused = 0

    def _tokens(self, caller: str) -> float:
        tokens, at = self._buckets.get(caller, (self.capacity, self._clock()))
        return min(self.capacity, tokens + (self._clock() - at) * self.refill_per_s)

    def retry_after_s(self, caller: str) -> int | None:
        """None: the caller may send; else the seconds until its bucket has a token."""
        tokens = self._tokens(caller)
        if tokens >= 1:
            return None
        self.num_refused += 1
        return max(1, math.ceil((1 - tokens) / self.refill_per_s))

    async def hold(self, caller: str) -> None:
        """Wait ``hold_s`` before a refusal, unless ``max_held`` of the caller's already wait
        (a caller cannot make the server hold its connections without bound)."""
        if self._held.get(caller, 0) >= self.max_held:
            return
        self._held[caller] = self._held.get(caller, 0) + 1
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self._held[caller] -= 1
            if not self._held[caller]:
                del self._held[caller]

    def charge(self, caller: str, status: int, num_body_bytes: int) -> None:
        if status not in self.CHARGED:
            return
        cost = 1.0 + num_body_bytes / 2**20
        self._buckets[caller] = (self._tokens(caller) - cost, self._clock())
        if len(self._buckets) > self.MAX_CALLERS:
            for other in [c for c in self._buckets if self._tokens(c) >= self.capacity]:
                del self._buckets[other]


# under /v1 but the admin's, not a tenant's: dashboard.AdminGate guards them, not the API keys
ADMIN_PATHS = frozenset({"/v1/usage"})


class AuthAndCount:
    """ASGI middleware: the tenant from the API key (``Authorization: Bearer`` or, as
    Anthropic's clients send it, ``x-api-key``; 401 before the body is read), the
    invalid-request budget of its caller (429 before the body is read), and the request
    counter by route and status."""

    def __init__(
        self,
        app,
        keys: dict[str, str],
        metrics: ServerMetrics,
        budget: InvalidRequestBudget | None = None,
    ) -> None:
        self.app = app
        self.keys = [(key.encode(), tenant) for key, tenant in keys.items()]
        self.metrics = metrics
        self.budget = budget  # None: no budget

    def tenant_of(self, scope) -> str | None:
        if not self.keys:
            return "default"
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        if not token:  # Anthropic's clients send the key as x-api-key
            token = headers.get(b"x-api-key", b"").strip()
        if not token:
            return None
        found = None
        for key, tenant in self.keys:  # compare with every key: no timing hint
            if hmac.compare_digest(key, token):
                found = tenant
        return found

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            keyed = path.startswith("/v1/") or path in TOKENIZER_PATHS
            if not keyed or path in ADMIN_PATHS:  # (AdminGate's)
                await self.app(scope, receive, send_counted)
                return
            tenant = self.tenant_of(scope)
            if tenant is None:
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>')",
                    code="invalid_api_key",
                )
                response = error_response(scope, error, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_counted)
                return
            scope.setdefault("state", {})["tenant"] = tenant
            if self.budget is None:
                await self.app(scope, receive, send_counted)
                return
            caller = tenant if self.keys else f"client {(scope.get('client') or ('',))[0]}"
            try:
                await self._budgeted(self.budget, caller, scope, receive, send_counted)
            finally:
                headers = dict(scope.get("headers") or [])
                length = headers.get(b"content-length", b"0")
                self.budget.charge(caller, status, int(length) if length.isdigit() else 0)
        finally:
            self.metrics.requests.labels(_route_label(path), str(status)).inc()

    async def _budgeted(
        self, budget: InvalidRequestBudget, caller: str, scope, receive, send
    ) -> None:
        """The app, unless ``caller``'s budget is spent: then a 429, before the body is read."""
        retry_after = budget.retry_after_s(caller)
        if retry_after is None:
            await self.app(scope, receive, send)
            return
        error = APIError(
            429,
            f"too many invalid requests from this caller: retry after {retry_after} s",
            code="invalid_request_budget",
        )
        # NOTE: and the connection closed, so that a body on its way is not read; held a
        # while first (a few at a time per caller): a client that ignores Retry-After then
        # sends a request per connection per hold, not hundreds a second that the server
        # would spend a core refusing
        response = error_response(
            scope, error, {"Retry-After": str(retry_after), "Connection": "close"}
        )
        await budget.hold(caller)
        await response(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413, refused by its
    Content-Length before a byte of it is read, or (a body sent without one) as soon as the
    bytes received pass the limit. Nothing past the limit is parsed or tokenized."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = APIError(413, self._message(), code="request_too_large")
            await error_response(scope, error)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body: larger than the server's limit of {self.max_bytes} bytes"


# not under /v1, yet a tenant's: they need the API key as the /v1 routes do
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
_ROUTES = frozenset(
    (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/kvwise/park",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/usage",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/dashboard",
        "/dashboard/data",
    )
)


def _route_label(path: str) -> str:
    if path in _ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"
