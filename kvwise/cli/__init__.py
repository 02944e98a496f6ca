"""Command line: ``kvwise generate | chat | size | serve | secret | bench | eval``; each has
``--help``. A flag it cannot use ends the command with one line naming it
(``kvwise: error: --flag: ...``) and exit status 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from kvwise.cli.engine_args import add_engine_args, engine_kwargs  # noqa: F401 (re-exported)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args: argparse.Namespace):
    from kvwise.types import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _engine_config(kwargs: dict):
    """The engine's config, with what can fail fast checked before the model loads: the
    model path, the store secret's strength and the disk tier's directory (ValueError naming
    the option)."""
    from kvwise.config import EngineConfig
    from kvwise.engine.store_factory import check_secret_strength, check_store_config

    if kwargs.get("kv_store_secret"):  # before StoreConfig's own, shorter, minimum
        check_secret_strength(kwargs["kv_store_secret"])
    config = EngineConfig.from_kwargs(**kwargs)
    model = config.model.model
    if model is not None:
        path = Path(model).expanduser()
        try:
            if path.is_dir():
                os.listdir(path)
            else:
                with open(path, "rb"):
                    pass
        except OSError as e:
            raise ValueError(f"model: cannot read '{model}': {e.strerror}") from None
    check_store_config(config.store)
    return config


def _make_llm(args: argparse.Namespace):
    from kvwise.engine.llm import LLM

    kwargs = engine_kwargs(args)
    _engine_config(kwargs)
    return LLM(
        progress=True, **{k: v for k, v in kwargs.items() if k != "model"}, model=kwargs["model"]
    )


def _stream(llm, prompt, params) -> tuple[str, object]:
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    return last.text, last


def _report(out) -> None:
    m = out.metrics
    n = len(out.token_ids)
    decode_time = (m.finished_time or 0) - (m.first_token_time or 0)
    rate = (n - 1) / decode_time if n > 1 and decode_time > 0 else float("nan")
    print(
        f"[{out.num_prompt_tokens} prompt tokens ({out.num_cached_tokens} cached), {n} generated, "
        f"TTFT {m.ttft * 1000:.0f} ms, {rate:.1f} tokens/s, finish: {out.finish_reason.value}, "
        f"K/V rows projected: {out.num_kv_rows_projected}]",
        file=sys.stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    prompt = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        prompt = [{"role": "user", "content": args.prompt}]
    _, out = _stream(llm, prompt, params)
    _report(out)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "kvwise chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text, out = _stream(llm, messages, params)
        messages.append({"role": "assistant", "content": text})
        _report(out)


def cmd_size(args: argparse.Namespace) -> int:
    from kvwise.perf.sizing import KVShape, report, shape_from_model
    from kvwise.utils import parse_bytes

    flags = (args.layers, args.heads, args.head_dim)
    if any(f is not None for f in flags):
        if any(f is None for f in flags):
            raise ValueError("layers: --layers, --heads and --head-dim go together")
        shape = KVShape(
            args.layers, args.heads, args.kv_heads or args.heads, args.head_dim, args.dtype
        )
    else:
        shape, name = shape_from_model(args.model, args.dtype)
        print(f"model: {name}")
    memory = parse_bytes(args.memory, "memory") if args.memory else None
    print(report(shape, args.tokens, args.batch, memory))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    from kvwise.engine.builder import build_engine
    from kvwise.models.default import DEFAULT_MODEL_NAME
    from kvwise.server import create_app, parse_api_keys
    from kvwise.server.dashboard import check_admin_key
    from kvwise.server.serving import DrainingServer
    from kvwise.server.transport import allowed_hosts_for
    from kvwise.utils import parse_bytes

    keys = parse_api_keys(args.api_key, os.environ.get("KVWISE_API_KEYS"))
    check_admin_key(args.admin_key, keys)  # before the model loads
    allowed_hosts = allowed_hosts_for(args.host, args.allowed_hosts)
    max_request_bytes = parse_bytes(args.max_request_bytes, "max_request_bytes")
    config = _engine_config({**engine_kwargs(args), "max_waiting": args.max_waiting})
    if args.served_model_name:
        name = args.served_model_name
    elif args.model:
        name = Path(args.model).stem if args.model.endswith(".gguf") else Path(args.model).name
    else:
        name = DEFAULT_MODEL_NAME
    app_kwargs = {
        "max_request_bytes": max_request_bytes,
        "admin_key": args.admin_key,
        "allowed_hosts": allowed_hosts,
    }
    if args.ray:
        return _serve_ray(args, keys, name, app_kwargs)
    engine = build_engine(config)
    from kvwise.server.transport import InvalidRequestBudget

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
    # that, then the app's lifespan stops the engine loop), and
    # afterwards re-raises the signal to the handler it found: make that one a no-op, so a
    # graceful shutdown exits with status 0.
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


def cmd_secret(args: argparse.Namespace) -> int:
    import secrets

    print(secrets.token_hex(32))
    return 0


def cmd_claims(args: argparse.Namespace) -> int:
    from kvwise.perf.claims import main

    return main(args)


def cmd_breakeven(args: argparse.Namespace) -> int:
    from kvwise.perf.predict import main

    return main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"kvwise.bench.{args.bench}").main(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from kvwise.bench.evaluate import run

    run(
        args.model,
        args.quantization,
        args.reference_quantization,
        args.ctx,
        stride=args.stride,
        max_windows=args.max_windows,
        text=args.text,
        json_path=args.json,
        self_check=args.self_check,
        progress=not args.no_progress,
        kv_cache_dtype=args.kv_cache_dtype,
        reference_kv_cache_dtype=args.reference_kv_cache_dtype,
        kv_int4_group_size=args.kv_int4_group_size,
        kv_block_size=args.kv_block_size,
    )
    return 0


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    from kvwise.config import QUANTIZATIONS

    p.add_argument(
        "--model", default=None, help="HF directory or .gguf (default: the default model)"
    )
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="auto", help="the candidate's weights"
    )
    p.add_argument(
        "--reference-quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="the reference's weights; equal to --quantization: the comparison is skipped",
    )
    kv_formats = ["float32", "bfloat16", "float16", "int8", "int4", "int4-pt"]
    p.add_argument("--kv-cache-dtype", choices=kv_formats, default="float32",
                   help="the KV format the candidate attends over (default float32; int4: keys "
                   "per channel over blocks of --kv-block-size tokens; int4-pt: keys per token, "
                   "measured only)")  # fmt: skip
    p.add_argument("--reference-kv-cache-dtype", choices=kv_formats, default="float32",
                   help="the KV format the reference attends over (default float32)")  # fmt: skip
    p.add_argument("--kv-int4-group-size", type=int, default=0,
                   help="int4 KV: channels per scale group (default 32)")  # fmt: skip
    p.add_argument("--kv-block-size", type=int, default=32,
                   help="int4: tokens per key block, each channel's scale group (default 32)")  # fmt: skip
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default: 512)")
    p.add_argument("--stride", type=int, default=None, help="tokens between windows (ctx // 2)")
    p.add_argument("--max-windows", type=int, default=None, help="stop after N windows (all)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON here")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="compare the candidate with itself (both forwards run): KL ~ 0, 100%% agreement",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwise", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate from one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("size", help="KV-cache bytes per token, request and batch")
    p.add_argument(
        "--model",
        default=None,
        help="config.json, HF directory or .gguf "
        "(default: the default model); or give the shape with the flags below",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = heads)")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument(
        "--dtype",
        default="float16",
        choices=["float32", "float16", "bfloat16", "fp8", "int8", "int4"],
    )
    p.add_argument("--tokens", type=int, default=4096, help="tokens per request")
    p.add_argument("--batch", type=int, default=16, help="requests per batch")
    p.add_argument("--memory", default=None, help="how many tokens fit in this, e.g. 24GiB")
    p.set_defaults(func=cmd_size)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat)")
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
    from kvwise.cluster.routing import ROUTING_MODES

    g.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default="cache-aware",
        help="cache-aware (default), power-of-two (Ray Serve's default) or round-robin",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "secret",
        help="print a new store secret (64 hex digits: 32 random bytes) for $KVWISE_KV_SECRET",
    )
    p.set_defaults(func=cmd_secret)

    p = sub.add_parser("bench", help="benchmarks against peers")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    b = bench_sub.add_parser(
        "throughput", help="decode, batched and prefill throughput vs transformers"
    )
    from kvwise.bench.throughput import add_args

    add_args(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "prefix", help="prefix caching: cached vs cold TTFT, overhead, KV memory utilisation"
    )
    from kvwise.bench.prefix import add_args as add_prefix_args

    add_prefix_args(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "load", help="concurrent streaming clients vs kvwise and llama.cpp servers on loopback"
    )
    from kvwise.bench.load import add_args as add_load_args

    add_load_args(b)
    b.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "chat", help="multi-turn chat: TTFT per turn, kvwise vs llama-server's slots"
    )
    from kvwise.bench.chat import add_args as add_chat_args

    add_chat_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "breakeven",
        help="TTFT vs prefix length: recompute vs a hit from each KV tier; break-even lengths",
    )
    from kvwise.bench.breakeven import add_args as add_breakeven_args

    add_breakeven_args(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    b = bench_sub.add_parser(
        "cluster",
        help="many tenants' chats on N Ray Serve replicas: cache-aware vs power-of-two vs "
        "round-robin routing vs one big replica",
    )
    from kvwise.bench.cluster import add_args as add_cluster_args

    add_cluster_args(b)
    b.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "claims", help="the break-even a published KV-cache speedup implies, under each model"
    )
    from kvwise.perf.claims import add_args as add_claims_args

    add_claims_args(p)
    p.set_defaults(func=cmd_claims)

    p = sub.add_parser(
        "breakeven",
        help="predict TTFT vs prefix length and each tier's break-even on hardware presets "
        "(a roofline), or on this machine once calibrated",
    )
    from kvwise.perf.predict import add_args as add_predict_args

    add_predict_args(p)
    p.set_defaults(func=cmd_breakeven)

    p = sub.add_parser(
        "eval", help="perplexity, KL divergence and top-1 agreement of a candidate vs a reference"
    )
    _add_eval_args(p)
    p.set_defaults(func=cmd_eval)
    return parser


def _naming_the_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """``field: ...`` → ``--field: ...`` when the command line has that flag (the config's
    messages name its fields; a user typed flags)."""
    field, sep, rest = message.partition(": ")
    flag = "--" + field.replace("_", "-")
    if sep and field.isidentifier() and flag in _option_strings(parser):
        return f"{flag}: {rest}"
    return message


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    start = time.perf_counter()
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvwise: error: {_naming_the_flag(str(e), parser)}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or directory the checks did not foresee
        logging.getLogger("kvwise").debug("the error", exc_info=True)
        print(f"kvwise: error: {e}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("kvwise").debug("done in %.1fs", time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
