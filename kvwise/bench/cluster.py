"""``kvwise bench cluster``: many tenants' multi-turn chats on N replicas, by routing policy.

The same deployment (``kvwise serve --ray``: Ray Serve, N replicas of one thread each, the
OpenAI endpoint) is started once per routing mode — ``cache-aware`` (kvwise's router),
``power-of-two`` (Ray Serve's default) and ``round-robin`` — and once as ``one big replica``
(one engine with every thread and the pools of all N), the hit rate the routers aim for.
Modes alternate within each round, ``--rounds`` rounds; medians pool the rounds.

Workload: ``--tenants`` tenants (an API key each) × ``--conversations`` conversations ×
``--turns`` turns, a pause of ``--think-s`` on average (exponential) before each later turn
(without one, two replicas and closed-loop clients make any least-loaded router sticky: the
replica a turn just left is the less busy one). Every conversation opens with the same public system prompt (declared
public: its KV is shared across tenants in whole chunks), then a document of its own (between
``--min-doc-tokens`` and ``--max-doc-tokens``: real text, slices of Python's language
reference) and a question; each turn streams ``--max-tokens`` greedy tokens and adds a short
follow-up. Every tenant sends the same documents, so a prefix hit across tenants would show:
the benchmark asserts that no request is served more cached tokens than its own conversation
(or the public prompt) computed before. ``--concurrency`` conversations run at once, in an
order that interleaves tenants. Reported per mode: prompt tokens served from cache (the
share, and as a fraction of the big replica's), TTFT p50 / p90 (client-side, streaming), how
many later turns landed on the replica of their previous turn, and the wall time; a PNG of
the TTFT distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from kvwise.bench.args import CLUSTER_MODES as MODES
from kvwise.bench.chat import _CHARS_PER_TOKEN, _slices
from kvwise.bench.common import sse_chunks, wait_ready
from kvwise.bench.progress import bar, phase

FOLLOW_UPS = (
    "Summarise that in one sentence.",
    "What is the most surprising detail above?",
    "Give one example that uses it.",
    "Which part would a beginner misread?",
    "Name a related feature.",
)


def _workload(args) -> tuple[str, list[str]]:
    rng = random.Random(args.seed)
    system, *docs = _slices(1 + args.conversations, int(args.max_doc_tokens * _CHARS_PER_TOKEN))
    system = (
        "You answer questions about the Python language. "
        + system[: int(args.system_tokens * _CHARS_PER_TOKEN)]
    )
    sized = []
    for doc in docs:
        tokens = rng.randint(args.min_doc_tokens, args.max_doc_tokens)
        sized.append(doc[: int(tokens * _CHARS_PER_TOKEN)])
    return system, sized


async def _conversation(http, url, key, system, doc, args, conv_index, records, public):
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{doc}\n\nWhat is this text about?"},
    ]
    computed = public  # tokens it may hit: its system message, then its own earlier turns
    previous_replica = None
    rng = random.Random(f"{args.seed}/{key}/{conv_index}")
    for turn in range(args.turns):
        if turn and args.think_s > 0:  # the user reads, types, or a tool runs
            await asyncio.sleep(rng.expovariate(1 / args.think_s))
        body = {
            "model": "kvwise",
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first, reply, usage = time.perf_counter(), None, [], None
        headers = {"Authorization": f"Bearer {key}"}
        async with http.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            replica = resp.headers.get("x-kvwise-replica")
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        first = first or time.perf_counter()
                        reply.append(choice["delta"]["content"])
        prompt, hit = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        if hit > computed:
            raise AssertionError(
                f"cross-tenant hit: {key} conversation {conv_index} turn {turn} was served "
                f"{hit} cached tokens; it had computed {computed}"
            )
        records.append(
            {
                "tenant": key,
                "conversation": conv_index,
                "turn": turn,
                "prompt_tokens": prompt,
                "cached_tokens": hit,
                "ttft_s": (first or time.perf_counter()) - start,
                "replica": replica,
                "same_replica": replica == previous_replica if turn else None,
            }
        )
        computed = prompt + usage["completion_tokens"]
        previous_replica = replica
        messages += [
            {"role": "assistant", "content": "".join(reply)},
            {"role": "user", "content": FOLLOW_UPS[(conv_index + turn) % len(FOLLOW_UPS)]},
        ]


async def _drive(
    url: str, keys: list[str], system: str, docs: list[str], args, public: int, label: str
):
    import httpx

    jobs = [(k, c) for c in range(len(docs)) for k in keys]  # interleaves the tenants
    records: list[dict] = []
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker(http, progress):
        while not queue.empty():
            key, c = queue.get_nowait()
            await _conversation(http, url, key, system, docs[c], args, c, records, public)
            progress.update(args.turns)

    async with httpx.AsyncClient(timeout=3600) as http:
        with bar(len(jobs) * args.turns, label, "turn") as progress:
            await asyncio.gather(*(worker(http, progress) for _ in range(args.concurrency)))
    return records


def _first_turn_bound(model_path: str, system: str, block: int = 16) -> int:
    """The most cached tokens a conversation's first turn may get: its system message (the
    public prompt, or the same tenant's earlier conversations), rounded up to a whole block
    plus one. Another tenant's copy of the same document would add hundreds more."""
    from kvwise.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(model_path)
    ids = tokenizer.encode_chat([{"role": "system", "content": system}], False)
    return (len(ids) // block + 2) * block


def _summary(records: list[dict], wall_s: float) -> dict:
    ttft = sorted(r["ttft_s"] for r in records)
    later = [r for r in records if r["turn"] > 0]
    return {
        "requests": len(records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "hit_share": sum(r["cached_tokens"] for r in records)
        / max(1, sum(r["prompt_tokens"] for r in records)),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "later_turns_on_previous_replica": sum(bool(r["same_replica"]) for r in later)
        / max(1, len(later)),
        "wall_s": wall_s,
    }


def main(args: argparse.Namespace) -> int:
    import logging
    import os

    from kvwise.bench.llamacpp import free_port
    from kvwise.cluster import ray_serve
    from kvwise.models.default import default_model_path

    logging.getLogger("httpx").setLevel(logging.WARNING)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes: unknown {bad}; known: {list(MODES)}")
    model_path = str(args.model or default_model_path())
    system, docs = _workload(args)
    public = _first_turn_bound(model_path, system)
    keys = {f"key-tenant-{t}": f"tenant-{t}" for t in range(args.tenants)}
    secret = os.environ.get(ray_serve.SECRET_ENV) or os.urandom(32).hex()
    base = {
        "model": model_path,
        "public_system_prompts": (system,),
        "kv_host_memory": "off",
        "kv_disk_path": "off",
        "max_num_batched_tokens": 2048,
    }
    if args.redis_url:
        base["kv_redis_url"] = args.redis_url
    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    per_replica = args.kv_cache_memory
    port = free_port()  # one for every mode: Serve's HTTP proxy outlives the applications
    results: dict[str, list[dict]] = {m: [] for m in modes}
    records_by_mode: dict[str, list[dict]] = {m: [] for m in modes}
    print(
        f"{args.tenants} tenants x {args.conversations} conversations x {args.turns} turns; "
        f"system prompt < {public} tokens; {args.replicas} replicas x {threads} threads, "
        f"{per_replica} KV each; modes {modes}; {args.rounds} rounds",
        flush=True,
    )
    for round_index in range(args.rounds):
        for mode in modes:
            records, wall = _run_mode(mode, port, base, keys, secret, system, docs, args, public)
            summary = _summary(records, wall)
            results[mode].append(summary)
            records_by_mode[mode] += records
            print(
                f"round {round_index + 1} {mode:>16}: hit {summary['hit_share']:.1%}, TTFT p50 "
                f"{summary['ttft_p50_s'] * 1000:.0f} ms p90 {summary['ttft_p90_s'] * 1000:.0f} "
                f"ms, later turns on their replica "
                f"{summary['later_turns_on_previous_replica']:.0%}, {wall:.0f} s",
                flush=True,
            )
    ray_serve.stop()
    _report(results, modes)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args) | {"func": None},
                    "results": results,
                    "records": records_by_mode,
                },
                indent=1,
            )
        )
    if args.plot:
        _plot(records_by_mode, args.plot, args.replicas)
    return 0


def _run_mode(mode, port, base, keys, secret, system, docs, args, public):
    """Deploy ``mode`` (``--replicas`` engines, or one with all their threads and pools), run
    the workload against it, take it down: (records, wall seconds)."""
    import os

    from kvwise.cluster import ray_serve
    from kvwise.utils import parse_bytes

    if args.redis_url:
        import redis

        redis.Redis.from_url(args.redis_url).flushall()
    cpus = os.cpu_count() or 1
    threads = max(1, cpus // args.replicas)
    big = mode == "one big replica"
    per_replica = args.kv_cache_memory
    engine_kwargs = dict(base)
    engine_kwargs["kv_cache_memory"] = (
        parse_bytes(per_replica, "kv_cache_memory") * args.replicas if big else per_replica
    )
    url = f"http://127.0.0.1:{port}"
    with phase(f"deploying {mode} on {url}"):
        ray_serve.start(
            engine_kwargs,
            port=port,
            num_cpus=cpus,
            replicas=1 if big else args.replicas,
            routing="cache-aware" if big else mode,
            threads_per_replica=threads * args.replicas if big else threads,
            api_keys=keys,
            secret=secret,
        )
        wait_ready(url)
    start = time.perf_counter()
    records = asyncio.run(_drive(url, list(keys), system, docs, args, public, f"cluster {mode}"))
    wall = time.perf_counter() - start
    ray_serve.stop(shutdown_ray=False)
    return records, wall


def _report(results: dict[str, list[dict]], modes: list[str]) -> None:
    med = {
        m: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for m, runs in results.items()
        if runs
    }
    big = med.get("one big replica")
    p2 = med.get("power-of-two")
    print("\nmedians over rounds:")
    print(
        f"{'mode':>16} | cached share | vs big | TTFT p50 | p50 vs it | TTFT p90 | on prev | wall"
    )
    for m in modes:
        s = med[m]
        vs_big = f"{s['cached_tokens'] / big['cached_tokens']:.2f}" if big else "-"
        vs_p2 = f"{p2['ttft_p50_s'] / s['ttft_p50_s']:.2f}x" if p2 else "-"
        print(
            f"{m:>16} | {s['hit_share']:>11.1%} | {vs_big:>6} | "
            f"{s['ttft_p50_s'] * 1000:>6.0f} ms | {vs_p2:>9} | {s['ttft_p90_s'] * 1000:>6.0f} ms"
            f" | {s['later_turns_on_previous_replica']:>6.0%} | {s['wall_s']:.0f} s"
        )
    print(
        "(p50 vs it: power-of-two's TTFT p50 / this mode's; vs big: cached tokens / the big "
        "replica's)"
    )


def _plot(records_by_mode: dict[str, list[dict]], path: str, replicas: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, records in records_by_mode.items():
        ttft = sorted(r["ttft_s"] * 1000 for r in records)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, client side)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"Multi-tenant multi-turn chat on {replicas} replicas: TTFT by routing")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
