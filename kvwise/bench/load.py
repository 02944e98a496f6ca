"""``kvwise bench load``: many concurrent streaming chat clients against OpenAI-compatible
servers on loopback, kvwise and llama.cpp's ``llama-server`` side by side, same GGUF, same
workload.

The peer is llama.cpp's own server as its users run it for many clients: parallel slots
(``-np``, by default one per client; ``--slots 8,16`` runs each count in turn), continuous
batching, a unified KV pool, its prompt cache on (per slot, plus its host-RAM prompt cache),
flash attention, the same thread count (kvwise/bench/llamacpp.py). Earlier versions of this benchmark used
llama-cpp-python's server instead, which runs one request at a time. With ``--vllm-python``
(or ``$KVWISE_VLLM_PYTHON``) vLLM's CPU build runs the same load too (``vllm_peer``: the
model as an HF directory, bf16, prefix caching on).

Each server is started as a subprocess on a free 127.0.0.1 port (or, with ``--url``, one
already running is loaded instead), loaded with ``--clients``
concurrent streaming clients for ``--duration`` seconds (bounded in time and in count), then
stopped. Prompts share one system prompt (prefix caching's best case) and differ in the user
question. Reported per server: requests ok / 429 / other errors, p50 and p99 TTFT, total
generated tokens per second; for kvwise also the pool state afterwards (no leaked blocks).
Progress on stderr: each server's start-up, and a bar over each load's seconds with its
requests so far (``bench/progress.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import time
from pathlib import Path

from kvwise.bench import llamacpp, vllm_peer
from kvwise.bench.common import kvwise_serve_cmd, percentile, serve_process, sse_chunks
from kvwise.bench.progress import TimedBar

SYSTEM_PROMPT = (
    "You are the support assistant of a small bicycle shop. Answer briefly and politely. "
    + " ".join(
        f"Rule {i}: when a customer asks about item {i}, mention that it ships in {i % 5 + 1} "
        "days and that returns are accepted within 30 days."
        for i in range(20)
    )
)
QUESTIONS = [
    "Do you sell helmets?",
    "How long does shipping take?",
    "Can I return a saddle?",
    "What tyres fit a road bike?",
    "Do you repair brakes?",
    "Is there a warranty on lights?",
    "Which lock do you recommend?",
    "Do you have kids' bikes?",
    "Can I pay in instalments?",
    "What are your opening hours?",
]


async def _client(
    http,
    url: str,
    model: str,
    deadline: float,
    budget: list[int],
    rng,
    max_tokens: int,
    stats: dict,
) -> None:
    while time.perf_counter() < deadline and budget[0] > 0:
        budget[0] -= 1
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": rng.choice(QUESTIONS)},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        start = time.perf_counter()
        first = None
        tokens = 0
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status_code == 429:
                    stats["429"] += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    continue
                if resp.status_code != 200:
                    stats["errors"][str(resp.status_code)] = (
                        stats["errors"].get(str(resp.status_code), 0) + 1
                    )
                    continue
                async for chunk in sse_chunks(resp):
                    choices = chunk.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        tokens += 1
                        if first is None:
                            first = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - a load test counts every failure
            stats["errors"][type(e).__name__] = stats["errors"].get(type(e).__name__, 0) + 1
            continue
        if first is not None:
            stats["ttft"].append(first - start)
            stats["started"].append(start)
        stats["tokens"] += tokens
        stats["ok"] += 1


async def _load(url: str, model: str, args: argparse.Namespace, label: str = "load") -> dict:
    import httpx

    stats = {"ok": 0, "429": 0, "errors": {}, "ttft": [], "started": [], "tokens": 0}
    budget = [args.max_requests]
    # a fresh connection per request: llama-server closes idle keep-alive connections after a
    # few seconds, and a request sent on one that is closing fails before it is read
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.duration + 60)
    key = getattr(args, "api_key", None)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    progress = TimedBar(args.duration, label, lambda: _counts(stats))
    ticker = asyncio.create_task(progress.run())
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as http:
            start = time.perf_counter()
            deadline = start + args.duration
            rngs = [random.Random(i) for i in range(args.clients)]
            await asyncio.gather(
                *(
                    _client(http, url, model, deadline, budget, rng, args.max_tokens, stats)
                    for rng in rngs
                )
            )
            wall = time.perf_counter() - start
    finally:
        ticker.cancel()
        progress.close()
    # the slowest first tokens, with when their requests were sent (seconds into the run)
    worst = sorted(zip(stats["ttft"], stats.pop("started")), reverse=True)[:5]
    ttft = sorted(stats.pop("ttft"))
    return {
        **stats,
        "slowest_ttft_s": [(round(t, 3), round(at - start, 2)) for t, at in worst],
        "wall_s": wall,
        "tokens_per_s": stats["tokens"] / wall,
        "ttft_p50_s": percentile(ttft, 0.50),
        "ttft_p99_s": percentile(ttft, 0.99),
    }


def _counts(stats: dict) -> dict:
    """What the progress bar shows of a load so far."""
    errors = sum(stats["errors"].values())
    return {"ok": stats["ok"], "429": stats["429"], "errors": errors, "tokens": stats["tokens"]}


def _serve(cmd: list[str], url: str, args, after=None) -> dict:
    return serve_process(
        cmd, url, lambda u: _load_served(u, args, after, "load kvwise"), name="kvwise serve"
    )


async def _load_served(url: str, args, after=None, label: str = "load") -> dict:
    """The load against the server at ``url`` (its model from /v1/models), then ``after``."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
    result = await _load(url, model, args, label)
    if after:
        result.update(after(url))
    return result


def _kvwise_after(url: str) -> dict:
    """The pool once the load is over: every block back, nothing running."""
    import httpx

    time.sleep(2.0)
    wanted = (
        "kvwise_kv_blocks_used",
        "kvwise_kv_blocks_total",
        "kvwise_requests_running",
        "kvwise_requests_waiting",
        "kvwise_prefix_cache_hits_tokens_total",
        "kvwise_prefix_cache_queries_tokens_total",
        "kvwise_engine_up",
        "kvwise_kv_integrity_checks_total",
    )
    after = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            after[name] = float(value)
    return {"after": after}


def main(args: argparse.Namespace) -> int:
    import logging

    import httpx

    from kvwise.models.default import default_model_path

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.url:
        return _load_running(args)
    gguf = str(Path(args.model) if args.model else default_model_path())
    results = {}
    port = llamacpp.free_port()
    url = f"http://127.0.0.1:{port}"
    results["kvwise"] = _serve(
        kvwise_serve_cmd(
            gguf, port, "--max-waiting", str(args.max_waiting), "--kv-cache-memory", "2GiB"
        ),
        url,
        args,
        after=_kvwise_after,
    )
    binary = None if args.no_llama_cpp else llamacpp.find_binary("llama-server", args.llama_cpp)
    if binary:
        import torch

        for slots in [int(n) for n in (args.slots or str(args.clients)).split(",")]:
            peer = llamacpp.LlamaServer(binary, gguf, torch.get_num_threads(), slots, args.slot_ctx)
            with peer:
                model = httpx.get(f"{peer.url}/v1/models", timeout=10).json()["data"][0]["id"]
                name = f"llama.cpp -np {slots}"
                results[name] = asyncio.run(_load(peer.url, model, args, f"load {name}"))
    elif not args.no_llama_cpp:
        print("llama.cpp skipped: llama-server not found (--llama-cpp DIR)")
    python = vllm_peer.find_python(args.vllm_python)
    if python:
        results["vllm"] = _vllm_load(python, args)
    _report(results, args)
    print("kvwise after the load:", json.dumps(results["kvwise"].get("after")))
    return 0


def _vllm_load(python: str, args: argparse.Namespace) -> dict:
    """The load against vLLM's CPU build (``vllm_peer``), its KV cache the tokens of kvwise's
    2 GiB pool in float32 (1 GiB of bf16)."""
    work = functools.partial(_load_served, args=args, label="load vllm")
    return vllm_peer.serve(python, args.vllm_model, 2**30, args.slot_ctx, work)


def _report(results: dict, args: argparse.Namespace) -> None:
    print("| server | ok | 429 | errors | TTFT p50 | TTFT p99 | tokens/s |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['ok']} | {r['429']} | {r['errors'] or 0} | "
            f"{r['ttft_p50_s']:.2f} s | {r['ttft_p99_s']:.2f} s | {r['tokens_per_s']:.1f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def _load_running(args: argparse.Namespace) -> int:
    """``--url``: the same load against a server someone else started."""
    import httpx

    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url: expected http://HOST:PORT, got {args.url!r}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ValueError(f"url: no server answers at {url} ({type(exc).__name__})") from None
    if r.status_code != 200:
        raise ValueError(f"url: GET {url}/v1/models answered {r.status_code} (--api-key?)")
    model = r.json()["data"][0]["id"]
    _report({url: asyncio.run(_load(url, model, args, f"load {url}"))}, args)
    return 0
