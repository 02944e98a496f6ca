"""``kvwise bench load`` against servers already running, interleaved round after round.

    python scripts/load_rounds.py --server kvwise=http://127.0.0.1:8200 \
        --server vllm=http://127.0.0.1:8100 --clients 32,64 --rounds 3 --duration 60 \
        --warmup 10 --out docs/bench/load_vs_vllm_rounds.json

For each client count every server is first warmed for ``--warmup`` seconds at that count
(not reported), then the servers take turns, one ``--duration`` load each per round; the report
is the median of the rounds per server and the ratio of the first server to each other one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
from pathlib import Path

import httpx

from kvwise.bench.load import _load

FIELDS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s")


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _run(url: str, clients: int, duration: float, max_tokens: int) -> dict:
    args = argparse.Namespace(
        clients=clients, duration=duration, max_tokens=max_tokens, max_requests=100_000,
        api_key=None,
    )  # fmt: skip
    return asyncio.run(_load(url, _model(url), args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", required=True, help="NAME=URL, first = ours")
    p.add_argument("--clients", default="32,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--warmup", type=float, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    servers = dict(s.split("=", 1) for s in args.server)
    report: dict = {"args": vars(args), "runs": {}}
    for clients in (int(c) for c in args.clients.split(",")):
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for url in servers.values() if args.warmup > 0 else ():
            _run(url, clients, args.warmup, args.max_tokens)
        for rnd in range(args.rounds):
            for name, url in servers.items():
                r = _run(url, clients, args.duration, args.max_tokens)
                runs[name].append(r)
                print(
                    f"clients {clients} round {rnd + 1} {name}: {r['tokens_per_s']:.1f} tok/s, "
                    f"TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
                    f"ok {r['ok']} errors {r['errors'] or 0}",
                    flush=True,
                )
        med = {
            n: {f: statistics.median(r[f] for r in rs) for f in FIELDS} for n, rs in runs.items()
        }
        first, *others = servers
        for name in servers:
            m = med[name]
            print(f"clients {clients} median {name}: {m['tokens_per_s']:.1f} tok/s, p50 "
                  f"{m['ttft_p50_s']:.3f} s, p99 {m['ttft_p99_s']:.3f} s", flush=True)  # fmt: skip
        for name in others:  # ours over each peer
            f = {k: med[first][k] / med[name][k] for k in FIELDS}
            print(f"clients {clients} {first} / {name}: tok/s {f['tokens_per_s']:.2f}x, "
                  f"p50 {f['ttft_p50_s']:.2f}x, p99 {f['ttft_p99_s']:.2f}x", flush=True)  # fmt: skip
        report["runs"][str(clients)] = {"rounds": runs, "median": med}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
