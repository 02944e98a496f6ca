"""kvwise on Ray Serve: N engine replicas behind one OpenAI endpoint, routed by where the KV is.

Three parts, each its own Ray process:

- ``EngineReplica`` (a Serve deployment, N replicas): one ``AsyncEngine`` with KV events on.
  It streams a request's outputs after a first item (admitted, or an error), and publishes
  what its device pool caches and evicts (numbered msgpack batches, ``event_sync``), its load
  (queued, running tokens) and its stats to the hub: every ``publish_interval_s``, and before
  it hands out a request's last output, so a conversation's next turn finds its blocks in the
  index. Ray restarts a replica whose health check fails (its engine loop died).
- ``EventHub`` (a named Ray actor, restarted by Ray if it dies): replicas push, routers pull.
- ``Ingress`` (a Serve deployment with ``@serve.ingress``): kvwise's own FastAPI app
  (``server/app.create_app``: routes, API keys → tenants, 429s, metrics) over a
  ``RemoteEngine`` whose transport is the replicas' deployment handle; the handle's router
  (``ray_router``) picks the replica from the request's block-hash chain.

The store secret reaches the replicas through Ray's runtime environment (``env_vars``), never a
command line; API keys are constructor arguments of the ingress. ``build_app`` assembles the
application; ``run`` is ``kvwise serve --ray``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from kvwise.cluster.event_sync import EventHub, EventPublisher
from kvwise.cluster.ray_router import HUB_NAMESPACE, ROUTERS
from kvwise.cluster.remote import (
    ADMITTED,
    RemoteEngine,
    ReplicaHeader,
    ReplicaSpec,
    RouteHint,
    error_to_wire,
)
from kvwise.errors import KVWiseError

logger = logging.getLogger("kvwise.cluster")

SECRET_ENV = "KVWISE_KV_SECRET"
APP_NAME = "kvwise"


@ray.remote(num_cpus=0, max_restarts=-1)
class EventHubActor:
    """``event_sync.EventHub`` as an actor, plus each replica's latest ``EngineStats`` and
    cost-model curves (``CostCurves``, for the dashboard)."""

    def __init__(self, ring: int = 1024) -> None:
        self.hub = EventHub(ring)
        self.stats: dict[str, Any] = {}
        self.curves: dict[str, Any] = {}

    def publish(self, replica: str, batches, load, stats=None, curves=None, acked=()) -> bool:
        if stats is not None:
            self.stats[replica] = stats
        if curves is not None:
            self.curves[replica] = curves
        return self.hub.publish(replica, batches, tuple(load), acked)

    def publish_snapshot(self, replica: str, seq: int, hashes) -> None:
        self.hub.publish_snapshot(replica, seq, hashes)

    def want_snapshot(self, replica: str) -> None:
        self.hub.want_snapshot(replica)

    def pull(self, cursors: dict[str, int], pending=None) -> dict:
        return self.hub.pull(cursors, pending)

    def drop(self, replica: str) -> None:
        self.hub.drop(replica)
        self.stats.pop(replica, None)
        self.curves.pop(replica, None)

    def replica_stats(self) -> dict[str, Any]:
        return dict(self.stats)

    def replica_curves(self) -> dict[str, Any]:
        return dict(self.curves)


class EngineReplica:
    def __init__(
        self, engine_kwargs: dict, hub_name: str, publish_interval_s: float = 0.05
    ) -> None:
        from kvwise.config import EngineConfig
        from kvwise.engine.async_engine import AsyncEngine
        from kvwise.engine.builder import build_engine_for_loop
        from kvwise.store.selftest import log_self_test

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        kwargs = dict(engine_kwargs, enable_kv_events=True)
        disk = kwargs.get("kv_disk_path")
        if disk != "off":  # one disk tier per replica rank: a restarted replica finds its own
            from kvwise.config import default_kv_disk_path

            rank = getattr(context.rank, "rank", 0)
            kwargs["kv_disk_path"] = os.path.join(disk or default_kv_disk_path(), f"rank-{rank}")
        self.llm_engine = build_engine_for_loop(EngineConfig.from_kwargs(**kwargs), progress=False)
        if self.llm_engine.store is not None:  # as `kvwise serve` does
            log_self_test(self.llm_engine.store)
        self.llm_engine.grammars.warm()
        self.engine = AsyncEngine(self.llm_engine)
        self.engine.start()
        self.publisher = EventPublisher(
            self.llm_engine.take_kv_events, self.llm_engine.kv_manager.cached_hashes
        )
        self.hub_name = hub_name
        self.publish_interval_s = publish_interval_s
        self._hub = None
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._want_snapshot = True  # a fresh replica: routers replace whatever they knew
        self._last_load: tuple[int, int] | None = None
        self._admitted: list[str] = []  # since the last publish: the routers' ack

    # ---- requests --------------------------------------------------------------------------

    async def generate(self, token_ids, params, options, request_id, route: RouteHint = None):
        self._ensure_publishing()
        try:
            stream = await self.engine.add_request(
                token_ids, params, options, request_id=request_id
            )
        except KVWiseError as exc:
            yield error_to_wire(exc)
            return
        self._admitted.append(request_id)
        yield (ADMITTED, self.replica_id)
        try:
            async for out in stream:
                if out.finished:  # the router sees this turn's blocks before the client does
                    await self._flush_quietly()
                yield out
        except KVWiseError as exc:
            yield error_to_wire(exc)
        finally:
            stream.close()

    async def park(self, session_id: str, tenant: str, route: RouteHint = None):
        self._ensure_publishing()
        try:
            parked = await self.engine.park(session_id, tenant)
        except KVWiseError as exc:
            return error_to_wire(exc)
        await self._flush_quietly()
        return parked

    async def spec(self, route: RouteHint = None) -> ReplicaSpec:
        self._ensure_publishing()
        engine = self.llm_engine
        return ReplicaSpec(engine.kv_manager.hasher, engine.runner.vocab_size, engine.max_model_len)

    async def identity(self, route: RouteHint = None) -> tuple[str, str]:
        """(replica id, Ray actor name)."""
        return self.replica_id, ray.get_runtime_context().get_actor_name()

    async def check_health(self) -> None:
        self._ensure_publishing()  # from the first health check on, routers know this replica
        if not self.engine.is_running:
            raise RuntimeError(self.engine.dead_reason or "the engine loop is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    # ---- publishing to the hub ---------------------------------------------------------------

    def _ensure_publishing(self) -> None:
        if self._task is None:
            self._lock = asyncio.Lock()
            self._task = asyncio.get_running_loop().create_task(self._publish_loop())

    def hub(self):
        if self._hub is None:
            self._hub = ray.get_actor(self.hub_name, namespace=HUB_NAMESPACE)
        return self._hub

    def _collect(self, engine, snapshot: bool):  # on the engine thread, between two steps
        batch = self.publisher.poll()
        return batch, engine.load_tokens(), self.publisher.snapshot() if snapshot else None

    async def flush(self, with_stats: bool = False) -> None:
        """Publish the events since the last flush and the load (and the stats)."""
        async with self._lock:
            snapshot = self._want_snapshot
            # admitted already, so the load collected next counts them
            acked, self._admitted = self._admitted, []
            batch, load, snap = await self.engine.call(lambda e: self._collect(e, snapshot))
            unchanged = batch is None and load == self._last_load and not snap
            if unchanged and not with_stats and not acked:
                return
            hub = self.hub()
            if snap is not None:
                await hub.publish_snapshot.remote(self.replica_id, *snap)
            stats = self.engine.stats() if with_stats else None
            curves = self.engine.cost_curves() if with_stats else None
            batches = [batch] if batch is not None else []
            self._want_snapshot = await hub.publish.remote(
                self.replica_id, batches, load, stats, curves, acked
            )
            self._last_load = load

    async def _flush_quietly(self) -> None:
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - the loop retries; the request goes on
            logger.warning("publishing to the event hub failed: %s", exc)
            self._hub = None
            self._want_snapshot = True

    async def _publish_loop(self) -> None:
        last_stats = 0.0
        while True:
            try:
                now = time.monotonic()
                with_stats = now - last_stats >= 1.0
                await self.flush(with_stats)
                if with_stats:
                    last_stats = now
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the hub restarting: snapshot when back
                logger.warning("publishing to the event hub failed: %s", exc)
                self._hub = None
                self._want_snapshot = True
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.publish_interval_s)


class RayTransport:
    """``remote.Transport`` over the replicas' deployment handle."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def generate(self, token_ids, params, options, request_id, route):
        return self.handle.options(stream=True).generate.remote(
            token_ids, params, options, request_id, route=route
        )

    async def park(self, session_id: str, tenant: str, route: RouteHint):
        return await self.handle.park.remote(session_id, tenant, route=route)

    async def spec(self) -> ReplicaSpec:
        return await self.handle.spec.remote(route=RouteHint())

    def is_replica_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))


@serve.ingress()
class Ingress:
    def __init__(self, replicas, hub_name, model_path, app_kwargs, chat_template=None) -> None:
        from kvwise.engine.chat_template import load_chat_template
        from kvwise.engine.tokenizer import Tokenizer

        self.hub_name = hub_name
        self.app_kwargs = app_kwargs
        tokenizer = Tokenizer.from_path(model_path)
        if chat_template is not None:  # --chat-template: the ingress renders the chats
            tokenizer.set_chat_template(load_chat_template(chat_template))
        self.engine = RemoteEngine(
            RayTransport(replicas),
            tokenizer,
            self._replica_stats,
            replica_curves=self._replica_curves,
        )

    async def _replica_stats(self):
        hub = ray.get_actor(self.hub_name, namespace=HUB_NAMESPACE)
        return await hub.replica_stats.remote()

    async def _replica_curves(self):
        hub = ray.get_actor(self.hub_name, namespace=HUB_NAMESPACE)
        return await hub.replica_curves.remote()

    def __serve_build_asgi_app__(self):
        from kvwise.server.app import create_app

        app = create_app(self.engine, **self.app_kwargs)
        app.add_middleware(ReplicaHeader)
        return app


# ---- assembling and running ----------------------------------------------------------------


def hub_name_for(app_name: str) -> str:
    return f"kvwise-hub-{app_name}"


_hubs: dict[str, Any] = {}  # the driver's handles: the hubs live as long as it does


def start_hub(app_name: str = APP_NAME):
    """The application's event hub (a named actor; the one already running, if any)."""
    hub = EventHubActor.options(
        name=hub_name_for(app_name), namespace=HUB_NAMESPACE, get_if_exists=True
    ).remote()
    ray.get(hub.pull.remote({}))  # up before the replicas look for it
    _hubs[app_name] = hub
    return hub


def build_app(
    engine_kwargs: dict,
    *,
    replicas: int = 2,
    routing: str = "cache-aware",
    threads_per_replica: int = 1,
    api_keys: dict[str, str] | None = None,
    model_name: str = "kvwise",
    app_name: str = APP_NAME,
    app_kwargs: dict | None = None,
    secret: str | None = None,
):
    """The Serve application: ``replicas`` engines (``threads_per_replica`` CPUs and torch
    threads each), the ingress over them, routed by ``routing`` (``ray_router.ROUTERS``).

    ``secret``: the store secret (default ``$KVWISE_KV_SECRET``), handed to the replicas in
    their runtime environment. Raises ValueError (naming the field) on bad arguments."""
    from kvwise.config import EngineConfig
    from kvwise.models.default import default_model_path

    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas: expected a positive integer, got {replicas!r}")
    if routing not in ROUTERS:
        raise ValueError(f"routing: expected one of {sorted(ROUTERS)}, got {routing!r}")
    if threads_per_replica < 1:
        raise ValueError(f"threads: expected at least 1 per replica, got {threads_per_replica}")
    kwargs = dict(engine_kwargs)
    secret = kwargs.pop("kv_store_secret", None) or secret or os.environ.get(SECRET_ENV)
    kwargs["num_threads"] = threads_per_replica
    if kwargs.get("kv_cache_memory") is None:  # the default share of RAM, split between them
        kwargs.setdefault("kv_cache_memory_fraction", 0.2 / replicas)
    config = EngineConfig.from_kwargs(**kwargs)  # bad options fail here, not in N replicas
    if config.store.kv_redis_url and not secret and not config.store.kv_redis_allow_no_secret:
        raise ValueError(
            "kv_store_secret: replicas sharing a Redis tier need one store secret: set "
            f"${SECRET_ENV} (handed to every replica through Ray's runtime environment)"
        )
    model_path = str(kwargs.get("model") or default_model_path())
    router_kwargs: dict[str, Any] = {}
    if routing == "cache-aware":
        router_kwargs = {"hub_name": hub_name_for(app_name), "block_size": config.cache.block_size}
    env = {SECRET_ENV: secret} if secret else {}
    replica = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=replicas,
        max_ongoing_requests=config.scheduler.max_num_seqs + (config.scheduler.max_waiting or 1024),
        ray_actor_options={"num_cpus": threads_per_replica, "runtime_env": {"env_vars": env}},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[routing], request_router_kwargs=router_kwargs
        ),
        health_check_period_s=2,
        health_check_timeout_s=30,
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}
    )
    app_kwargs = {"api_keys": api_keys, "model_name": model_name, **(app_kwargs or {})}
    hub, template = hub_name_for(app_name), kwargs.get("chat_template")
    return ingress.bind(replica.bind(kwargs, hub), hub, model_path, app_kwargs, template)


def start(
    engine_kwargs: dict,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    app_name: str = APP_NAME,
    **build_kwargs: Any,
) -> None:
    """Start (or join) Ray, the hub and the application; returns once it serves."""
    if not ray_address:
        cpus = num_cpus or os.cpu_count() or 1
        need = build_kwargs.get("replicas", 2) * build_kwargs.get("threads_per_replica", 1)
        if need > cpus:
            raise ValueError(
                f"replicas: {build_kwargs.get('replicas', 2)} replicas of "
                f"{build_kwargs.get('threads_per_replica', 1)} threads need {need} CPUs; "
                f"the local Ray has {cpus} (fewer --replicas or --threads, or --ray-address)"
            )
    if not ray.is_initialized():
        init: dict[str, Any] = {"namespace": HUB_NAMESPACE, "log_to_driver": False}
        if ray_address:
            init["address"] = ray_address
        else:
            init.update(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False)
        ray.init(**init)
    start_hub(app_name)
    serve.start(http_options={"host": host, "port": port})
    serve.run(
        build_app(engine_kwargs, app_name=app_name, **build_kwargs),
        name=app_name,
        route_prefix="/",
    )


def stop(app_name: str = APP_NAME, *, shutdown_ray: bool = True) -> None:
    try:
        serve.delete(app_name)
        _hubs.pop(app_name, None)
        ray.kill(ray.get_actor(hub_name_for(app_name), namespace=HUB_NAMESPACE))
    except Exception:  # noqa: BLE001 - already gone
        pass
    if shutdown_ray:
        serve.shutdown()
        ray.shutdown()


def run(engine_kwargs: dict, *, host: str, port: int, **kwargs: Any) -> int:
    """``kvwise serve --ray``: serve until SIGINT / SIGTERM, then take the application down."""
    done = threading.Event()
    previous = {}
    try:
        start(engine_kwargs, host=host, port=port, **kwargs)
        # NOTE: after ray.init, which installs its own SIGTERM handler (a stack dump)
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: done.set())
        logger.info(
            "serving on http://%s:%d/v1: %d replicas on Ray Serve, %s routing",
            host,
            port,
            kwargs.get("replicas", 2),
            kwargs.get("routing", "cache-aware"),
        )
        done.wait()
        logger.info("shutting down: deleting the application")
    finally:
        stop(kwargs.get("app_name", APP_NAME), shutdown_ray=not kwargs.get("ray_address"))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
