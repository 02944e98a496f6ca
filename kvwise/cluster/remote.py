"""The ingress side of a deployment: an engine that lives in other processes, behind the same
interface as ``AsyncEngine`` (``engine/client.EngineClient``), so the OpenAI app
(``server/app.create_app``) serves it unchanged.

``RemoteEngine`` turns a prompt into token ids and its tenant-rooted block-hash chain here (the
replicas' tokenizer, block size and hash roots), and hands both to a transport — in the Ray
deployment, a call on the replicas' deployment handle whose router reads the chain
(``ray_router.py``). A replica answers with a first item (admitted, or an error) and then the
request's outputs; errors cross the process boundary as plain tuples (``error_to_wire``) and
are raised here as the same ``KVWiseError`` types, so the app answers with the same statuses.
A replica that dies under a request ends it with ``ReplicaFailedError`` (503, retryable);
before admission the request is retried on another replica. No Ray import here.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvwise import errors
from kvwise.core.hashing import BlockHash, BlockHasher
from kvwise.core.kv_stats import KVCacheStats
from kvwise.engine.client import RequestStream
from kvwise.engine.prompts import Prompt, Tokenizer, detokenize_ids, tokenize_prompt
from kvwise.engine.stats import EngineStats
from kvwise.errors import EngineDeadError, KVWiseError, ReplicaFailedError
from kvwise.store.costmodel import CostCurves
from kvwise.store.stats import StoreStats
from kvwise.types import RequestOptions, RequestOutput, SamplingParams

logger = logging.getLogger("kvwise.cluster")

ADMITTED = "admitted"
ERROR = "error"


@dataclass(frozen=True)
class RouteHint:
    """What the router reads off a request: the prompt's block-hash chain and length, the
    replica that served this session's last turn, ``pin`` (a replica that must take it:
    ``park``, tests), and the request's id (the replica acknowledges it by that id)."""

    chain: tuple[BlockHash, ...] = ()
    num_tokens: int = 0
    session_replica: str | None = None
    pin: str | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class ReplicaSpec:
    """What the ingress needs from the replicas to tokenize and hash as they do."""

    hasher: BlockHasher
    vocab_size: int
    max_model_len: int


# ---- errors across processes ---------------------------------------------------------------


def error_to_wire(exc: KVWiseError) -> tuple:
    """``(ERROR, type name, param, detail, retry_after_s)``: rebuilt by ``error_from_wire``."""
    detail = getattr(exc, "detail", str(exc))
    return (ERROR, type(exc).__name__, exc.param, detail, getattr(exc, "retry_after_s", None))


def error_from_wire(item: tuple) -> KVWiseError:
    _, name, param, detail, retry_after = item
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.InvalidRequest):
        return cls(param, detail)
    if cls is errors.QueueFullError:
        return errors.QueueFullError(retry_after if retry_after is not None else 1)
    if isinstance(cls, type) and issubclass(cls, KVWiseError):
        return cls(detail)
    return errors.EngineStepError(f"the replica failed: {name}: {detail}")


# ---- statistics of many engines as one -------------------------------------------------------


def merge_stats(stats: list[EngineStats]) -> EngineStats | None:
    """Many replicas' stats as one engine's: counts and gauges summed (tiers by name; a tier
    the replicas share, such as one Redis, is counted once per replica), utilisation averaged."""
    if not stats:
        return None
    if len(stats) == 1:
        return stats[0]
    kv = _sum_dataclass([s.kv for s in stats], KVCacheStats)
    kv = dataclasses.replace(kv, utilization=sum(s.kv.utilization for s in stats) / len(stats))
    stores = [s.store for s in stats if s.store is not None]
    store = None
    if stores:
        tiers = {}
        for name in dict.fromkeys(t for s in stores for t in s.tiers):
            parts = [s.tiers[name] for s in stores if name in s.tiers]
            degraded = "; ".join(dict.fromkeys(p.degraded for p in parts if p.degraded))
            tiers[name] = _sum_dataclass(parts, type(parts[0]), degraded=degraded, health=None)
        store = _sum_dataclass(stores, StoreStats, tiers=tiers)
    oldest = max(s.oldest_waiting_s for s in stats)  # a wait, not a count: the longest
    return _sum_dataclass(stats, EngineStats, kv=kv, store=store, oldest_waiting_s=oldest)


def _sum_dataclass(items: list, cls: type, **given: Any):
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name not in values and f.init:
            values[f.name] = sum(getattr(item, f.name) for item in items)
    return cls(**values)


# ---- the engine interface over a transport ---------------------------------------------------


class Transport(Protocol):
    """How the ingress reaches the replicas (the Ray deployment's handle, or a test's fake)."""

    def generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        options: RequestOptions,
        request_id: str,
        route: RouteHint,
    ) -> AsyncIterator[Any]: ...

    async def park(self, session_id: str, tenant: str, route: RouteHint) -> tuple | int: ...

    async def spec(self) -> ReplicaSpec: ...

    def is_replica_failure(self, exc: BaseException) -> bool: ...


class RemoteStream(RequestStream):
    """``RequestStream`` over a replica's item stream: closing it cancels the call there."""

    def __init__(self, request_id: str, replica: str, items: AsyncIterator[Any], cancel) -> None:
        super().__init__(request_id)
        self.replica = replica
        self._items = items
        self._cancel = cancel

    async def _next_item(self) -> RequestOutput | BaseException:
        try:
            item = await self._items.__anext__()
        except StopAsyncIteration:
            return ReplicaFailedError(f"replica {self.replica} ended the request unfinished")
        except Exception as exc:
            return _failure(f"replica {self.replica} failed during the request", exc)
        return error_from_wire(item) if isinstance(item, tuple) else item

    def _abort(self) -> None:
        self._cancel()


def _failure(what: str, exc: Exception) -> KVWiseError:
    """A replica's call failed: its own error as it is, anything else (the actor died, the
    call was lost) as ``ReplicaFailedError``, which the client may retry."""
    if isinstance(exc, KVWiseError):
        return exc
    return ReplicaFailedError(f"{what} ({type(exc).__name__}); retry it")


@dataclass
class _Stats:
    current: EngineStats | None = None
    by_replica: dict[str, EngineStats] = field(default_factory=dict)


class RemoteEngine:
    """An ``EngineClient`` (add_request, park, stats, max_model_len, is_running, ...) over
    replicas reached through ``transport``.

    Args:
        transport: see ``Transport``.
        tokenizer: the replicas' tokenizer (loaded here from the same model).
        replica_stats: returns each replica's latest ``EngineStats`` (the hub's copy), polled
            every ``stats_interval_s`` for ``/metrics``.
        replica_curves: returns each replica's latest cost-model curves (``CostCurves``; a
            replica without tiers publishes none), polled with the stats, for the dashboard.
        admission_retries: a replica that fails before admitting a request: try this many more.
        max_sessions: sessions whose last replica is remembered (least recent forgotten).
    """

    def __init__(
        self,
        transport: Transport,
        tokenizer: Tokenizer,
        replica_stats: Callable[[], Awaitable[dict[str, EngineStats]]] | None = None,
        *,
        replica_curves: Callable[[], Awaitable[dict[str, CostCurves]]] | None = None,
        stats_interval_s: float = 1.0,
        admission_retries: int = 2,
        max_sessions: int = 100_000,
    ) -> None:
        self.transport = transport
        self.tokenizer = tokenizer
        self._replica_stats = replica_stats
        self._replica_curves = replica_curves
        self._curves: dict[str, CostCurves] = {}
        self.stats_interval_s = stats_interval_s
        self.admission_retries = admission_retries
        self.max_sessions = max_sessions
        self._spec: ReplicaSpec | None = None
        self._spec_lock: asyncio.Lock | None = None
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._stats = _Stats()
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._dead: str | None = None

    # ---- what the app reads --------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        if self._spec is None:
            raise EngineDeadError("no replica has answered yet")
        return self._spec.max_model_len

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._dead is None and self._spec is not None

    @property
    def dead_reason(self) -> str | None:
        if self._stopped:
            return "the engine is shut down"
        return self._dead or (None if self._spec else "waiting for the first replica")

    def stats(self) -> EngineStats:
        current = self._stats.current
        if current is None:
            kv = KVCacheStats(0, 0, 0, 0, 0, 0, 0, 0.0)
            return EngineStats(0, 0, 0, 0, kv)
        return current

    def replica_stats(self) -> dict[str, EngineStats]:
        return dict(self._stats.by_replica)

    def cost_curves(self) -> CostCurves | None:
        """One replica's cost-model curves (the first by name that published any: each
        replica fits its own, on the same hardware), or None."""
        return self._curves[min(self._curves)] if self._curves else None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the stats poll (on the running event loop); idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    def shutdown(self, timeout: float | None = None) -> None:
        self.stop()

    async def _poll(self) -> None:
        while not self._stopped:
            try:
                await self.ensure_spec()
                if self._replica_stats is not None:
                    by_replica = await self._replica_stats()
                    self._stats = _Stats(merge_stats(list(by_replica.values())), by_replica)
                    if not by_replica:  # /health: 503 until a replica has reported
                        raise EngineDeadError("no replica has reported yet")
                if self._replica_curves is not None:
                    self._curves = await self._replica_curves()
                self._dead = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported by /health, retried
                self._dead = f"no replica reachable: {type(exc).__name__}: {exc}"
            await asyncio.sleep(self.stats_interval_s)

    async def ensure_spec(self) -> ReplicaSpec:
        if self._spec is None:
            if self._spec_lock is None:
                self._spec_lock = asyncio.Lock()
            async with self._spec_lock:
                if self._spec is None:
                    self._spec = await self.transport.spec()
        return self._spec

    # ---- requests --------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions | None = None,
        *,
        request_id: str | None = None,
    ) -> RemoteStream:
        """Tokenize and hash the prompt, route it, and return its stream once a replica has
        admitted it (errors as ``AsyncEngine.add_request``)."""
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        spec = await self.ensure_spec()
        options = options or RequestOptions()
        request_id = request_id or f"req-{uuid.uuid4().hex}"

        def tokenize_and_hash() -> tuple[list[int], list]:
            ids = tokenize_prompt(self.tokenizer, prompt, spec.vocab_size, spec.max_model_len)
            return ids, spec.hasher.chain(ids, options.tenant, options.cache_salt)

        # NOTE: on a worker thread: a large prompt never holds up the ingress's event loop
        token_ids, chain = await asyncio.to_thread(tokenize_and_hash)
        session = (options.tenant, options.session_id) if options.session_id else None
        route = RouteHint(
            tuple(chain),
            len(token_ids),
            self._sessions.get(session) if session else None,
            request_id=request_id,
        )
        for attempt in range(self.admission_retries + 1):
            items = self.transport.generate(token_ids, params, options, request_id, route)
            try:
                first = await items.__anext__()
            except Exception as exc:
                _cancel(items)
                if self.transport.is_replica_failure(exc) and attempt < self.admission_retries:
                    logger.warning("%s: replica failed before admitting it; retrying", request_id)
                    continue
                raise _failure("no replica admitted the request", exc) from None
            break
        if first[0] == ERROR:
            raise error_from_wire(first)
        replica = first[1]
        note = _served_by.get()
        if note is not None:
            note.append(replica)
        if session:
            self._remember(session, replica)
        stream = RemoteStream(request_id, replica, items, lambda: _cancel(items))
        return stream

    async def tokenize(self, prompt: Prompt, tenant: str = "default") -> list[int]:
        """The ids ``add_request`` computes for ``prompt`` (here, with the replicas'
        tokenizer: no replica is asked), on a worker thread."""
        spec = await self.ensure_spec()
        return await asyncio.to_thread(
            tokenize_prompt, self.tokenizer, prompt, spec.vocab_size, spec.max_model_len
        )

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens included), on a worker thread."""
        spec = await self.ensure_spec()
        return await asyncio.to_thread(detokenize_ids, self.tokenizer, token_ids, spec.vocab_size)

    async def tool_pause(self, request_id: str) -> int:
        """``EngineClient.tool_pause``: nothing is kept across replicas (each replica's own
        prefix cache and the router's affinity keep the turn's blocks warm): 0."""
        return 0

    async def park(self, session_id: str, tenant: str = "default") -> int:
        """Park a session on the replica that served its last turn (404 when none did)."""
        replica = self._sessions.get((tenant, session_id))
        if replica is None:
            raise errors.SessionNotFound(
                "session_id", f"no finished turn of session '{session_id}' on any replica"
            )
        try:
            result = await self.transport.park(session_id, tenant, RouteHint(pin=replica))
        except Exception as exc:
            raise _failure(f"replica {replica} failed during park", exc) from None
        if isinstance(result, tuple):
            raise error_from_wire(result)
        note = _served_by.get()
        if note is not None:
            note.append(replica)
        return result

    def _remember(self, session: tuple[str, str], replica: str) -> None:
        self._sessions[session] = replica
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


# the replica that admitted the current HTTP request, for ``ReplicaHeader``
_served_by: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "kvwise_served_by", default=None
)


class ReplicaHeader:
    """ASGI middleware: ``x-kvwise-replica`` names the replica that served a generation or
    park request (the route's ``RemoteEngine.add_request`` records it)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note: list[str] = []
        token = _served_by.set(note)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start" and note:
                headers = list(message.get("headers") or [])
                headers.append((b"x-kvwise-replica", note[-1].encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _served_by.reset(token)


def _cancel(items: Any) -> None:
    cancel = getattr(items, "cancel", None)
    if cancel is not None:
        cancel()
