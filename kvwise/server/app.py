"""The OpenAI-compatible HTTP app: JSON in, typed engine requests out, JSON / SSE back.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream``: server-sent events ending
with ``data: [DONE]``), GET /v1/models, GET /health, GET /version (kvwise's, torch's, the
model), GET /metrics (Prometheus text), the extension POST /v1/kvwise/park, GET /dashboard
(with /dashboard/data, its JSON) and the admin's GET /v1/usage (the bill per tenant:
``usage.py``).

Sessions: a request's ``prompt_cache_key`` is its engine session id (within its tenant).
``POST /v1/kvwise/park {"prompt_cache_key": ...}`` moves that conversation's KV from the device
pool down to the tiers (host RAM, disk, Redis) until its next turn, which loads it back; it runs
on the engine thread between two steps and waits for the tier writes.

APIs: OpenAI's routes here (``routes.py``), each further API a module of its own registered
by ``add_routes(app, context)`` (``messages.py``: Anthropic's Messages; ``openai_responses.py``:
OpenAI's Responses; ``tokenize.py``; ``usage.py``), all on the API-neutral
``generation.Generation``; errors and stream framing follow the dialect of the path
(``dialects.py``).

Tenants: with API keys configured, every /v1 route needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY`` (401 otherwise) and the key alone names the tenant, so one tenant's prompts never hit another's
cache. Without keys every request is tenant ``default``. /health and /metrics are open.

Hosts: with ``allowed_hosts`` set, a request whose Host header names another host gets 421
before anything runs, /health included (``transport.HostCheck``): a web page cannot reach a
keyless loopback server through a DNS name it controls (DNS rebinding). ``kvwise serve`` on a
loopback address allows only loopback names by default.

Dashboard: GET /dashboard, a live page over the server's own stats (``dashboard.py``); with
API keys (or an admin key) set it needs the admin key, never a tenant's.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
under /v1/messages: ``dialects.py``): 400 bad input
(naming the field; text that is no Unicode included), 401, 404 unknown model, route (naming the routes served) or
session, 408 a request line and headers or a body not received in time (answered by the
server: see ``serving.py``), 409 park of a session with a request in flight, 413 a body over
the limit (refused before it is parsed), 421 a Host header not allowed, 429 (with
Retry-After) when the engine's waiting queue is full, 431 a request line and headers over
16 KiB (answered by the server before the app: see ``serving.py``), 503 when the engine is
down. A stream that fails (a failed step, the engine
stopping, a shutdown: see ``serving.py``) ends with an error event and ``[DONE]``. A client
that disconnects, streaming or not, has its request aborted and its KV blocks freed before the
next engine step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from kvwise.engine.async_engine import AsyncEngine
from kvwise.engine.client import EngineClient
from kvwise.engine.llm_engine import LLMEngine
from kvwise.server import messages, openai_responses, tokenize, usage
from kvwise.server.conversations import StoreLimits
from kvwise.server.dashboard import AdminGate, Dashboard, check_admin_key
from kvwise.server.generation import ServerContext
from kvwise.server.metrics import ServerMetrics
from kvwise.server.outputs import (
    ChatCompletionResponse,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    ParkResponse,
)
from kvwise.server.price_sheet import PriceSheet
from kvwise.server.protocol import ErrorResponse
from kvwise.server.responses import install_error_handlers
from kvwise.server.routes import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    OpenAIRoutes,
)
from kvwise.server.transport import (
    AuthAndCount,
    BodyLimit,
    HostCheck,
    InvalidRequestBudget,
    parse_allowed_hosts,
)
from kvwise.version import __version__, torch_version

_ERRORS = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "bad input; `param` names the field"),
        (401, "missing or invalid API key"),
        (404, "unknown model"),
        (429, "waiting queue full; see Retry-After"),
        (503, "engine not running"),
    )
}
_PARK_ERRORS = {
    **{code: _ERRORS[code] for code in (400, 401, 503)},
    404: {"model": ErrorResponse, "description": "no finished turn of this prompt_cache_key"},
    409: {"model": ErrorResponse, "description": "a request of this session is in flight"},
}
_DESCRIPTION = (
    "OpenAI's Chat Completions, Completions and Responses and Anthropic's Messages over the "
    "kvwise engine."
)
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}
# far above any prompt the model's context holds (a 131,072-token context is ~0.5 MB of text)
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


def create_app(
    engine: EngineClient | LLMEngine,
    api_keys: dict[str, str] | None = None,
    model_name: str = "kvwise",
    *,
    default_completion_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    admin_key: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
    invalid_request_budget: InvalidRequestBudget | None = None,
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    price_sheet: PriceSheet | str | Path | None = None,
    responses_store: StoreLimits | None = None,
) -> FastAPI:
    """Build the app over one engine.

    Args:
        engine: an `EngineClient` (`AsyncEngine`, `RemoteEngine`; the caller owns it: the app
            starts it but never shuts it down) or an `LLMEngine` (wrapped in an `AsyncEngine`;
            shut down with the app).
        api_keys: key → tenant; None or empty: no auth, every request is tenant ``default``.
        model_name: the one name served; a request naming another model gets 404.
        max_request_bytes: a larger request body gets 413 before it is parsed.
        admin_key: the key /dashboard needs (see ``dashboard.py``); ValueError if it is
            blank or a tenant's key.
        allowed_hosts: the Host header values served (``transport.allowed_hosts_for``: a
            name or address, any port unless it has ``:port``; ``*``: any); another is a
            421. None: any. ValueError if one is no host.
        invalid_request_budget: how many invalid requests (4xx) a caller may send before it
            gets a 429 ahead of reading its body (``transport.InvalidRequestBudget``); None:
            no limit. ``kvwise serve`` sets one.
        max_sequences_per_request: n x prompts above it is a 400 naming ``n`` (or
            ``prompt``); ValueError if below 1.
        price_sheet: prices the bill per tenant (``GET /v1/usage``): a ``PriceSheet`` or a
            sheet's path (``PriceSheet.load``'s ValueError); None: tokens only.
        responses_store: each tenant's bounds on stored Responses (None: the defaults).
    """
    price_sheet = PriceSheet.of(price_sheet)
    allowed = None if allowed_hosts is None else parse_allowed_hosts(allowed_hosts)
    keys = dict(api_keys or {})
    admin_key = check_admin_key(admin_key, keys)
    owned = AsyncEngine(engine) if isinstance(engine, LLMEngine) else None
    client: EngineClient = owned if owned is not None else engine
    metrics = ServerMetrics(client)
    dashboard = Dashboard(client, metrics, model_name, price_sheet=price_sheet)
    lifespan = _lifespan(client, dashboard, owned)
    app = FastAPI(title="kvwise", version="0.1.0", description=_DESCRIPTION, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.dashboard = client, metrics, dashboard
    app.state.model_name, app.state.responses_store_limits = model_name, responses_store
    install_error_handlers(app)
    budget = invalid_request_budget
    _add_middleware(app, keys, admin_key, metrics, max_request_bytes, budget, allowed)
    routes = OpenAIRoutes(
        client, metrics, model_name, default_completion_max_tokens, max_sequences_per_request
    )
    _add_routes(app, routes, ServerContext(routes.gen, admin_key, list(keys), price_sheet))
    dashboard.add_routes(app)
    return app


def _add_middleware(app, keys, admin_key, metrics, max_request_bytes, budget, allowed) -> None:
    """The middleware, innermost first: the admin gate, the body limit, auth and the
    request counter, then (outermost: before anything runs) the Host check."""
    app.add_middleware(AdminGate, admin_key=admin_key, tenant_keys=list(keys))
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(AuthAndCount, keys=keys, metrics=metrics, budget=budget)
    if allowed is not None:
        app.add_middleware(HostCheck, allowed=allowed)


def _add_version_route(app: FastAPI, model_name: str) -> None:
    """GET /version: kvwise's version, torch's and the served model's name (open, as /health)."""
    body = {"version": __version__, "torch": torch_version(), "model": model_name}

    @app.get("/version")
    async def version() -> dict:
        return body


def _lifespan(engine: EngineClient, dashboard: Dashboard, owned: AsyncEngine | None):
    """Start the engine and the dashboard's sampler with the app; shut down ``owned`` (the
    engine the app wrapped itself) when the app stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        sampler = asyncio.create_task(dashboard.history.run())
        try:
            yield
        finally:
            sampler.cancel()
            if owned is not None:
                await asyncio.to_thread(owned.shutdown)

    return lifespan


def _add_routes(app: FastAPI, routes: OpenAIRoutes, context: ServerContext) -> None:
    """OpenAI's routes and the app's own, then each further API's module, then /version."""
    _add_openai_routes(app, routes)
    for dialect_routes in (messages, openai_responses, tokenize, usage):  # each its own module
        dialect_routes.add_routes(app, context)
    _add_version_route(app, routes.model_name)


def _add_openai_routes(app: FastAPI, routes: OpenAIRoutes) -> None:
    generation = {**_ERRORS, 200: {"content": _SSE}}
    app.post("/v1/completions", response_model=CompletionResponse, responses=generation)(
        routes.completions
    )
    app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=generation)(
        routes.chat_completions
    )
    app.post("/v1/kvwise/park", response_model=ParkResponse, responses=_PARK_ERRORS)(routes.park)
    app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})(
        routes.list_models
    )
    app.get("/v1/models/{model}", response_model=ModelCard, responses=_ERRORS)(routes.get_model)
    app.get(
        "/health",
        response_model=Health,
        response_model_exclude_none=True,
        responses={503: {"model": Health}},
    )(routes.health)
    app.get("/metrics", response_class=Response)(routes.prometheus_metrics)
