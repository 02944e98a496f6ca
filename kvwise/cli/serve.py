"""``kvwise serve``: the OpenAI-compatible HTTP server, one engine in this process (uvicorn,
drained on SIGTERM / Ctrl-C) or N replicas on Ray Serve (``--ray``). What can fail fast (API
and admin keys, allowed hosts, sizes, the engine's config) is checked before the model loads.
Its flags import no torch; the engine, the server and uvicorn are imported when it runs."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from kvwise.cli.engine_args import engine_config, engine_kwargs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY=TENANT",
        help="accept Bearer KEY as TENANT (repeatable; also KVWISE_API_KEYS='k1=a,k2=b'); "
        "with keys set, requests without a valid key get 401",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="bounded waiting queue: past it requests get 429 with Retry-After",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients send")
    p.add_argument(
        "--admin-key",
        default=os.environ.get("KVWISE_ADMIN_KEY") or None,
        help="the key GET /dashboard needs (also $KVWISE_ADMIN_KEY); without it the dashboard "
        "is open when no --api-key is set, off when one is",
    )
    p.add_argument(
        "--price-sheet",
        default=None,
        metavar="FILE",
        help="prices per million tokens (JSON, or TOML by its .toml name: input, output, "
        "cache_read, cache_write_5m, cache_write_1h, optional currency) that GET /v1/usage "
        "and the dashboard turn each tenant's tokens into cost with (docs/SERVER.md)",
    )
    _add_limit_args(p)
    _add_responses_args(p)
    _add_ray_args(p)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds open requests get to finish on SIGTERM / Ctrl-C",
    )
    p.add_argument(
        "--max-request-bytes",
        default="8MiB",
        help="largest request body accepted; past it a 413, before the body is parsed",
    )
    p.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOST[,HOST...]",
        help="the Host header values served (repeatable; a name or address, any port unless "
        "given as HOST:PORT; '*': any); another gets 421. Default: bound to a loopback "
        "address, only localhost, 127.0.0.1 and [::1]; bound to any other, any host",
    )
    p.add_argument(
        "--max-sequences-per-request",
        type=_positive_int,
        default=64,
        metavar="N",
        help="most sequences (n x prompts) one request may ask for; above it a 400 naming n "
        "or prompt (default 64: --max-num-seqs' default, one full batch)",
    )
    p.add_argument(
        "--header-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="a request's line and headers must arrive within this, else a 408 and the "
        "connection closed (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a request's whole body must arrive within this of its headers, else a 408 "
        "(default 30)",
    )


def _add_responses_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "stored Responses (POST /v1/responses with store: true, the default)",
        "each tenant's responses and their conversations, for previous_response_id and "
        "GET / DELETE /v1/responses/{id}; per tenant, least recently used first out",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=_seconds,
        default=3600.0,
        metavar="SECONDS",
        help="a stored response is kept this long after it was stored or last "
        "continued (default 3600)",
    )
    g.add_argument(
        "--responses-store-memory",
        default="64MiB",
        metavar="BYTES",
        help="each tenant's stored responses, counted as JSON (default 64MiB)",
    )
    g.add_argument(
        "--responses-store-max",
        type=_positive_int,
        default=10_000,
        metavar="N",
        help="most stored responses per tenant (default 10000)",
    )


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    from kvwise.cluster.routing import ROUTING_MODES

    g = p.add_argument_group(
        "many replicas (Ray Serve; pip install 'kvwise[ray]')",
        "N engine replicas behind this one endpoint, each request routed to the replica whose "
        "KV cache holds the longest prefix of it (weighed against load); the engine flags "
        "apply to each replica, --threads and --kv-cache-memory per replica",
    )
    g.add_argument("--ray", action="store_true", help="serve with N replicas on Ray Serve")
    g.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. 10.0.0.1:6379 or auto); default: start a local Ray",
    )
    g.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default="cache-aware",
        help="cache-aware (default), power-of-two (Ray Serve's default) or round-robin",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from kvwise.server import create_app, parse_api_keys  # no torch: the checks answer at once
    from kvwise.server.conversations import StoreLimits
    from kvwise.server.dashboard import check_admin_key
    from kvwise.server.price_sheet import PriceSheet
    from kvwise.server.transport import InvalidRequestBudget, allowed_hosts_for
    from kvwise.utils import parse_bytes

    keys = parse_api_keys(args.api_key, os.environ.get("KVWISE_API_KEYS"))
    check_admin_key(args.admin_key, keys)  # before the model loads
    allowed_hosts = allowed_hosts_for(args.host, args.allowed_hosts)
    app_kwargs = {
        "max_request_bytes": parse_bytes(args.max_request_bytes, "max_request_bytes"),
        "admin_key": args.admin_key,
        "allowed_hosts": allowed_hosts,
        "max_sequences_per_request": args.max_sequences_per_request,
        "responses_store": StoreLimits(
            ttl_s=args.responses_store_ttl,
            max_bytes=parse_bytes(args.responses_store_memory, "responses_store_memory"),
            max_responses=args.responses_store_max,
        ),
        "price_sheet": PriceSheet.load(args.price_sheet) if args.price_sheet else None,
    }
    # the default disk tier: a directory of this server's own, kv-<port>
    kwargs = {**engine_kwargs(args), "kv_disk_default_name": str(args.port)}
    config = engine_config({**kwargs, "max_waiting": args.max_waiting})
    name = _served_name(args)
    check_port_free(args.host, args.port)  # the last check before the model loads
    if args.ray:
        return _serve_ray(args, keys, name, app_kwargs)
    from kvwise.engine.builder import build_engine_for_loop  # torch
    from kvwise.store.selftest import log_self_test

    engine = build_engine_for_loop(config)  # stepped by the AsyncEngine's thread
    if engine.store is not None:  # each tier seals, writes, reads back and opens one entry
        log_self_test(engine.store)
    engine.grammars.warm()
    app_kwargs["invalid_request_budget"] = InvalidRequestBudget()
    app = create_app(engine, api_keys=keys, model_name=name, **app_kwargs)
    logging.getLogger("kvwise").info(
        "serving %s on http://%s:%d/v1 (%s; %s)",
        name,
        args.host,
        args.port,
        f"{len(keys)} API keys" if keys else "no API keys: every request is tenant 'default'",
        f"Host: {', '.join(allowed_hosts)}" if allowed_hosts else "any Host",
    )
    return _run_server(args, app)


def check_port_free(host: str, port: int) -> None:
    """ValueError naming ``port`` (or ``host``) unless a server could listen on
    ``host:port`` now: a bind test, as uvicorn binds (``SO_REUSEADDR``: a port held only by
    closed connections in TIME_WAIT is free), so a port in use is said before the model loads.
    """
    import errno
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"port: expected 0-65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e.strerror}") from None
    for family, kind, proto, _, address in infos[:1]:  # uvicorn binds the first
        where = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(
                        f"port: {where} is already in use (another server, perhaps another "
                        "kvwise: stop it, or choose another --port)"
                    ) from None
                if e.errno == errno.EACCES:
                    raise ValueError(
                        f"port: {where}: permission denied (ports under 1024 need privileges)"
                    ) from None
                raise ValueError(f"host: cannot listen on {where}: {e.strerror}") from None


def _served_name(args: argparse.Namespace) -> str:
    from kvwise.models.default import DEFAULT_MODEL_NAME

    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return Path(args.model).stem if args.model.endswith(".gguf") else Path(args.model).name
    return DEFAULT_MODEL_NAME


def _run_server(args: argparse.Namespace, app) -> int:
    import signal

    import uvicorn

    from kvwise.server.serving import DrainingServer

    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="debug" if args.verbose else "info",
            timeout_graceful_shutdown=args.shutdown_timeout,
        ),
        app.state.engine,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )
    # uvicorn turns SIGTERM and Ctrl-C into a graceful shutdown (stop accepting, give open
    # requests --shutdown-timeout seconds, ending open streams with an error event just before
    # that, then the app's lifespan stops the engine loop), and afterwards re-raises the signal
    # to the handler it found: make that one a no-op, so a graceful shutdown exits with 0.
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _serve_ray(args: argparse.Namespace, keys: dict, name: str, app_kwargs: dict) -> int:
    try:
        from kvwise.cluster import ray_serve
    except ImportError as exc:
        raise ValueError(f"ray: --ray needs Ray Serve ({exc}): pip install 'kvwise[ray]'") from None
    if args.replicas < 1:
        raise ValueError(f"replicas: expected at least 1, got {args.replicas}")
    kwargs = {**engine_kwargs(args), "max_waiting": args.max_waiting}
    if kwargs.get("kv_disk_path") is None:  # each replica takes rank-<n> under this server's
        from kvwise.machine import kvwise_cache_dir

        kwargs["kv_disk_path"] = os.path.join(kvwise_cache_dir(), f"kv-{args.port}")
    if kwargs.get("chat_template"):  # its text: no Ray actor needs the file
        from kvwise.engine.chat_template import load_chat_template

        kwargs["chat_template"] = load_chat_template(kwargs["chat_template"])
    threads = kwargs.pop("num_threads") or max(1, (os.cpu_count() or 1) // args.replicas)
    return ray_serve.run(
        kwargs,
        host=args.host,
        port=args.port,
        ray_address=args.ray_address,
        replicas=args.replicas,
        routing=args.routing,
        threads_per_replica=threads,
        api_keys=keys,
        model_name=name,
        app_kwargs=app_kwargs,
    )
