"""Every ``kvwise`` subcommand, in one table: its name, its help line, the function that adds
its flags and the function that runs it, each named as ``"module:function"``.

Contract: a command's modules are imported only when they are needed. Its ``add_args`` module
is imported when the parser is built, so it must import no torch (nor anything heavy) at
module level: ``tests/unit/test_cli_layout.py`` builds the whole parser and checks. Its
``run`` module is imported only when that command runs. ``run(args) -> int`` is the exit
status; a ``ValueError`` it raises is a user's mistake, printed as one line naming the flag.

Adding a command is one row here, plus its module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str  # "size"; "bench throughput": a subcommand of the group "bench"
    help: str
    run: str | None  # "module:function" running it; None: a group of subcommands
    add_args: str | None = None  # "module:function" adding its flags; None: none
    engine_flags: bool = False  # it builds an engine: it takes the engine and KV-tier flags

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.name.split())


def resolve(ref: str) -> Callable:
    """The function a ``"module:function"`` reference names (importing its module)."""
    module, _, function = ref.partition(":")
    return getattr(importlib.import_module(module), function)


_GEN = "kvwise.cli.generate"
_BENCH_ARGS = "kvwise.bench.args"

COMMANDS: tuple[Command, ...] = (
    Command(
        "generate",
        "generate from one prompt, streamed to the terminal",
        f"{_GEN}:run_generate",
        f"{_GEN}:add_generate_args",
        engine_flags=True,
    ),
    Command(
        "chat",
        "interactive multi-turn chat",
        f"{_GEN}:run_chat",
        f"{_GEN}:add_chat_args",
        engine_flags=True,
    ),
    Command(
        "size",
        "KV-cache bytes per token, request and batch",
        "kvwise.cli.size:run",
        "kvwise.cli.size:add_args",
    ),
    Command(
        "serve",
        "OpenAI-compatible HTTP server (/v1/completions, /v1/chat)",
        "kvwise.cli.serve:run",
        "kvwise.cli.serve:add_args",
        engine_flags=True,
    ),
    Command(
        "secret",
        "print a new store secret (64 hex digits: 32 random bytes) for $KVWISE_KV_SECRET",
        "kvwise.cli.secret:run",
    ),
    Command("bench", "benchmarks against peers", None),
    Command(
        "bench throughput",
        "decode, batched and prefill throughput vs transformers",
        "kvwise.bench.throughput:main",
        f"{_BENCH_ARGS}:add_throughput_args",
        engine_flags=True,
    ),
    Command(
        "bench prefix",
        "prefix caching: cached vs cold TTFT, overhead, KV memory utilisation",
        "kvwise.bench.prefix:main",
        f"{_BENCH_ARGS}:add_prefix_args",
        engine_flags=True,
    ),
    Command(
        "bench load",
        "concurrent streaming clients vs kvwise and llama.cpp servers on loopback",
        "kvwise.bench.load:main",
        f"{_BENCH_ARGS}:add_load_args",
    ),
    Command(
        "bench chat",
        "multi-turn chat: TTFT per turn, kvwise vs llama-server's slots",
        "kvwise.bench.chat:main",
        f"{_BENCH_ARGS}:add_chat_args",
    ),
    Command(
        "bench agents",
        "agents calling tools with long-tailed pauses: turns/s and "
        "post-tool latency, tiers vs pool only vs no cache vs llama-server",
        "kvwise.bench.agents:main",
        f"{_BENCH_ARGS}:add_agents_args",
    ),
    Command(
        "bench breakeven",
        "TTFT vs prefix length: recompute vs a hit from each KV tier; break-even lengths",
        "kvwise.bench.breakeven:main",
        f"{_BENCH_ARGS}:add_breakeven_args",
        engine_flags=True,
    ),
    Command(
        "bench cluster",
        "many tenants' chats on N Ray Serve replicas: cache-aware vs "
        "power-of-two vs round-robin routing vs one big replica",
        "kvwise.bench.cluster:main",
        f"{_BENCH_ARGS}:add_cluster_args",
    ),
    Command(
        "claims",
        "the break-even a published KV-cache speedup implies, under each model",
        "kvwise.perf.claims:main",
        "kvwise.perf.claims:add_args",
    ),
    Command(
        "breakeven",
        "predict TTFT vs prefix length and each tier's break-even on "
        "hardware presets (a roofline), or on this machine once calibrated",
        "kvwise.perf.predict:main",
        "kvwise.perf.predict:add_args",
    ),
    Command(
        "eval",
        "perplexity, KL divergence and top-1 agreement of a candidate vs a reference",
        "kvwise.cli.eval:run",
        "kvwise.cli.eval:add_args",
    ),
)
