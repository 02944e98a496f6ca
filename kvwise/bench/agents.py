"""``kvwise bench agents``: agents that call tools, the seed article's case for a slow KV tier.

``--agents`` agents run at once, ``--rounds`` rounds each: a model turn that must call a tool
(``tool_choice: required``, one function), the tool's pause (a seeded long-tailed latency:
lognormal with median ``--tool-median-s`` and p90 ``--tool-p90-s``), then the tool's result
(about ``--result-tokens`` tokens of real text) joins the history for the next turn, so the
histories grow to several thousand tokens. The pool is sized to hold about a quarter of all
the agents' contexts (``--pool-memory``): while an agent waits, others push its KV out of the
pool, and its next turn finds it in a tier, or recomputes it.

Configurations, one after the other (``--configs``): ``tiers`` (kvwise serve, host and disk
tiers on), ``pool`` (tiers off), ``no-cache`` (prefix caching off), ``llama.cpp``
(llama-server with a slot per agent, ``--jinja``, when found), ``vllm`` (vLLM's CPU build
from its own venv, prefix caching on, the same model as an HF directory: ``vllm_peer``).
Reported per configuration: model turns per second of wall time and per second of the time
with a turn in flight (``in_flight_s``: the server's rate, without the stretches in which every
agent waits for its tool, such as the end of a run, when only the slowest agents' long tool
calls are left), the latency of the turns after a tool result (p50, p99: the time to the whole
answer, and TTFT, the time to its first content or tool-call delta — answers are streamed, as
agents stream them), the prompt tokens cached, and kvwise's tool-pause counts. Progress on
stderr: each server's start-up and a bar over each run's turns (``bench/progress.py``).

``--apis chat,messages,responses`` runs each of kvwise's configurations in each API
(``bench/agent_apis.py``: the same conversation and one forced call a turn in every API; the
full history each turn): what the API layer costs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvwise.bench import agent_apis, llamacpp, vllm_peer
from kvwise.bench.chat import _CHARS_PER_TOKEN, _slices
from kvwise.bench.common import kvwise_serve_cmd, percentile, serve_process, sse_chunks
from kvwise.bench.progress import bar

TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the documentation for a query",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


def tool_latencies(count: int, median_s: float, p90_s: float, seed: int) -> list[float]:
    """Seeded lognormal latencies with the given median and 90th percentile."""
    sigma = math.log(p90_s / median_s) / 1.2816  # z of the 90th percentile
    rng = random.Random(seed)
    return [median_s * math.exp(sigma * rng.gauss(0, 1)) for _ in range(count)]


def _first_messages(task: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a research agent. Use the search tool."},
        {"role": "user", "content": task},
    ]


async def _agent(http, url, model, task, results, sleeps, max_tokens, record, key, api) -> None:
    messages = _first_messages(task)
    headers = {"Authorization": f"Bearer {key}"}
    for i, result in enumerate(results):
        body = agent_apis.request_body(api, model, messages, TOOL, max_tokens)
        start = time.perf_counter()
        if api == "chat":
            answer = await _streamed_answer(http, f"{url}/v1/chat/completions", body, headers)
        else:
            path = url + agent_apis.PATHS[api]
            answer = await agent_apis.streamed_answer(http, path, api, body, headers)
        first, usage, calls = answer["first_s"] - start, answer["usage"], answer["calls"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        end = time.perf_counter()
        record(i, end - start, usage.get("prompt_tokens") or 0, cached, key, first, start, end)
        calls = calls or [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "x"}'},
            }
        ]
        messages.append(
            {"role": "assistant", "content": answer["content"] or None, "tool_calls": calls[:1]}
        )
        await asyncio.sleep(sleeps[i])
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": result})


async def _streamed_answer(http, url: str, body: dict, headers: dict) -> dict:
    """A streamed chat answer reassembled: its content, its calls (id, name, arguments), its
    usage, and when its first content or tool-call delta arrived (``first_s``)."""
    content, calls, usage, first = [], {}, {}, None
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {text[:300]}")
        async for chunk in sse_chunks(resp):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if (delta.get("content") or delta.get("tool_calls")) and first is None:
                    first = time.perf_counter()
                content.append(delta.get("content") or "")
                for d in delta.get("tool_calls") or ():
                    call = calls.setdefault(
                        d.get("index", 0),
                        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    call["id"] = d.get("id") or call["id"]
                    function = d.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
    return {
        "content": "".join(content),
        "calls": [calls[k] for k in sorted(calls)],
        "usage": usage,
        "first_s": first or time.perf_counter(),
    }


async def _agents_load(
    url: str, args: argparse.Namespace, label: str = "agents", api: str = "chat"
) -> dict:
    import httpx

    texts = _slices(args.agents * (args.rounds + 1), int(args.result_tokens * _CHARS_PER_TOKEN))
    sleeps = tool_latencies(
        args.agents * args.rounds, args.tool_median_s, args.tool_p90_s, args.seed
    )
    # (round, latency, prompt, cached, key, time to first delta, sent at, answered at)
    turns: list[tuple] = []
    keys = [f"key-{a % abs(args.tenants)}" for a in range(args.agents)]
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        model = (await http.get(f"{url}/v1/models", headers=_auth(keys[0]))).json()["data"][0]["id"]
        primed = await _prime(http, url, model, args, texts, keys)
        start = time.perf_counter()
        with bar(args.agents * args.rounds, label, "turn") as progress:

            def record(*turn) -> None:
                turns.append(turn)
                progress.update()

            await asyncio.gather(
                *(
                    _agent(
                        http,
                        url,
                        model,
                        texts[a * (args.rounds + 1)],
                        texts[a * (args.rounds + 1) + 1 : (a + 1) * (args.rounds + 1)],
                        sleeps[a * args.rounds : (a + 1) * args.rounds],
                        args.max_tokens,
                        record,
                        keys[a],
                        api,
                    )
                    for a in range(args.agents)
                )
            )
        wall = time.perf_counter() - start
        resp = await http.get(f"{url}/metrics", headers=_auth(keys[0]))
        metrics = resp.text if resp.status_code == 200 else ""
    after = [t for t in turns if t[0] > 0]
    latencies, ttfts = sorted(t[1] for t in after), sorted(t[5] for t in after)
    in_flight = in_flight_s([(t[6], t[7]) for t in turns])
    return {
        "turns": len(turns),
        "wall_s": wall,
        "busy_s": sum(t[1] for t in turns),
        "turns_per_s": len(turns) / wall,
        "in_flight_s": in_flight,
        "turns_per_in_flight_s": len(turns) / in_flight,
        "post_tool_p50_s": statistics.median(latencies),
        "post_tool_p99_s": percentile(latencies, 0.99),
        "post_tool_ttft_p50_s": statistics.median(ttfts),
        "post_tool_ttft_p99_s": percentile(ttfts, 0.99),
        "prompt_tokens": sum(t[2] for t in turns),
        "cached_tokens": sum(t[3] for t in turns),
        "cross_tenant_full_hits": _cross_tenant_hits(turns, primed),
        "tool_metrics": [
            line
            for line in metrics.splitlines()
            if line.startswith(("kvwise_tool_", "kvwise_preemptions_total"))
        ],
        # each turn's (round, sent, answered), seconds from the start: a timeline of the run
        "spans": sorted((t[0], round(t[6] - start, 3), round(t[7] - start, 3)) for t in turns),
    }


def in_flight_s(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of the (sent, answered) spans was open: the time the
    server had a turn to work on. Turns over it are the server's rate, where turns over the
    wall time also count the stretches in which every agent waits for its tool (at the end of a
    run, the long tail of the slowest agents' tool calls)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _prime(http, url, model, args, texts, keys) -> dict[str, int]:
    """With several tenants: tenant 0 first sends every other tenant's agents' first turn, so
    that a tenant whose first turn then hits its whole prompt has read tenant 0's blocks.
    Returns those first prompts' full cached blocks' tokens by key (what such a hit caches)."""
    primed: dict[str, int] = {}
    for a in range(args.agents):
        if abs(args.tenants) < 2 or keys[a] == keys[0]:
            continue
        body = {
            "model": model,
            "messages": _first_messages(texts[a * (args.rounds + 1)]),
            "tools": [TOOL],
            "tool_choice": "required",
            "max_tokens": 1,
        }
        resp = await http.post(f"{url}/v1/chat/completions", json=body, headers=_auth(keys[0]))
        prompt = (resp.json().get("usage") or {}).get("prompt_tokens") or 0
        primed[keys[a]] = min(primed.get(keys[a], prompt), prompt)
    return primed


def _cross_tenant_hits(turns, primed: dict[str, int]) -> int | None:
    """First turns of other tenants that cached their whole prompt, which only tenant 0 had
    computed (0: none; None: one tenant)."""
    if not primed:
        return None
    return sum(1 for t in turns if t[0] == 0 and t[4] in primed and t[3] >= primed[t[4]] - 16)


def _kvwise_cmd(
    gguf: str, port: int, config: str, pool: str, disk: str, tenants: int, kv_dtype: str = "auto"
) -> list[str]:
    cmd = kvwise_serve_cmd(gguf, port, "--kv-cache-memory", pool, "--kv-cache-dtype", kv_dtype)
    for t in range(abs(tenants) if abs(tenants) > 1 else 0):  # < 0: the keys share one tenant
        cmd += ["--api-key", f"key-{t}=tenant-{t if tenants > 0 else 0}"]
    if config == "tiers":
        return cmd + ["--kv-disk-path", disk, "--kv-store-min-tokens", "16"]
    cmd += ["--kv-host-memory", "off", "--kv-disk-path", "off"]
    return cmd + (["--no-prefix-caching"] if config == "no-cache" else [])


def _context(args: argparse.Namespace) -> int:
    """Tokens an agent's history reaches, with room to spare."""
    return (args.result_tokens + args.max_tokens + 200) * (args.rounds + 1) + 512


def _vllm(python: str, args: argparse.Namespace) -> dict:
    """The agents against vLLM's CPU build (``vllm_peer``), its KV cache (bf16) as many tokens
    as kvwise's pool holds in its format (float32: half the bytes)."""
    from kvwise.core.kv_spec import kv_format
    from kvwise.utils import parse_bytes

    dtype = "float32" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    per_value = kv_format(dtype).bytes_per_value  # its scales apart
    kv_bytes = int(parse_bytes(args.pool_memory, "pool_memory") * 2 / per_value)
    work = functools.partial(_agents_load, args=args, label="agents vllm")
    return vllm_peer.serve(python, args.vllm_model, kv_bytes, _context(args), work)


def _run(config: str, gguf: str, args: argparse.Namespace, api: str = "chat") -> dict | None:
    """One run of the agents against ``config``'s server (None: its peer is not installed),
    in ``api`` (kvwise's configurations; the peers speak chat)."""
    if config == "vllm":
        python = vllm_peer.find_python(args.vllm_python)
        if not python:
            print("vllm skipped: no python of vLLM's venv (--vllm-python)")
            return None
        return _vllm(python, args)
    if config == "llama.cpp":
        binary = llamacpp.find_binary("llama-server", args.llama_cpp)
        if not binary:
            print("llama.cpp skipped: llama-server not found (--llama-cpp DIR)")
            return None
        import torch

        server = llamacpp.LlamaServer(
            binary, gguf, torch.get_num_threads(), args.agents, _context(args)
        )
        with server:
            return asyncio.run(_agents_load(server.url, args, "agents llama.cpp"))
    with tempfile.TemporaryDirectory() as disk:
        port = llamacpp.free_port()
        cmd = _kvwise_cmd(
            gguf, port, config, args.pool_memory, disk, args.tenants, args.kv_cache_dtype
        )
        url = f"http://127.0.0.1:{port}"
        work = functools.partial(_agents_load, args=args, label=f"agents {config}", api=api)
        return serve_process(cmd, url, work, name=f"kvwise serve ({config})")


def _runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(configuration, API) of one round: each of kvwise's configurations in each of
    ``--apis``, the peers in chat."""
    apis = args.apis.split(",")
    bad = [api for api in apis if api not in agent_apis.APIS]
    if bad:
        raise SystemExit(f"--apis: {bad[0]!r} is not one of {', '.join(agent_apis.APIS)}")
    peers = ("llama.cpp", "vllm")
    return [(c, a) for c in args.configs.split(",") for a in (["chat"] if c in peers else apis)]


def _medians(runs: list[dict]) -> dict:
    """Each number's median over the runs (the last run's other fields), and the runs."""
    out = dict(runs[-1])
    for key, value in runs[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out | {"runs": runs} if len(runs) > 1 else out


def main(args: argparse.Namespace) -> int:
    import logging

    from kvwise.models.default import default_model_path

    logging.getLogger("httpx").setLevel(logging.WARNING)
    gguf = str(Path(args.model) if args.model else default_model_path())
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.repeat):  # the configurations interleaved, round after round
        for config, api in _runs(args):
            r = _run(config, gguf, args, api)
            if r is None:
                continue
            config = config if api == "chat" else f"{config} ({api})"
            runs.setdefault(config, []).append(r)
            print(
                f"round {round_ + 1}, {config}: {r['turns']} turns, {r['turns_per_s']:.3f} "
                f"turns/s of wall time, {r['turns_per_in_flight_s']:.3f} of the "
                f"{r['in_flight_s']:.0f} s with a turn in flight, post-tool answer p50 "
                f"{r['post_tool_p50_s']:.2f} s p99 "
                f"{r['post_tool_p99_s']:.2f} s, first delta p50 {r['post_tool_ttft_p50_s']:.2f}"
                f" s p99 {r['post_tool_ttft_p99_s']:.2f} s, cached {r['cached_tokens']:,} of "
                f"{r['prompt_tokens']:,} prompt tokens, cross-tenant full hits "
                f"{r['cross_tenant_full_hits']}",
                flush=True,
            )
    results = {config: _medians(rs) for config, rs in runs.items()}
    if args.repeat > 1:
        for config, r in results.items():
            print(
                f"median of {args.repeat}, {config}: {r['turns_per_s']:.3f} turns/s of wall "
                f"time, {r['turns_per_in_flight_s']:.3f} in flight, "
                f"post-tool answer p50 {r['post_tool_p50_s']:.2f} s, first delta p50 "
                f"{r['post_tool_ttft_p50_s']:.2f} s"
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"args": vars(args) | {"func": None}, "results": results}, indent=2, default=str
            )
        )
    return 0
