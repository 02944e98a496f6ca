"""Cached-hit TTFT against one served decode step at the same context (issue 30).

For each of ``--reps`` prompts of ``--tokens`` random token ids (``/v1/completions`` takes
token-id prompts, so the length is exact): the prompt cold, the same prompt again at once
(its KV maybe still on its way to the tiers), and again after ``--settle`` seconds; then a
fresh prompt of the same length decoded for 33 tokens, whose median gap between streamed
tokens is one decode step at that context as a client sees it. Every request streams with
temperature 0. Prints medians and the ratios and writes them as JSON (``--out``).

    python scripts/cached_ttft.py [--url URL] [--tokens 2048] [--reps 7] [--out F.json]

Without ``--url`` it starts ``kvwise serve`` (its defaults: host and disk tiers on, the disk
tier in a temporary directory) on a free loopback port.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

import httpx


def stream(http: httpx.Client, url: str, ids: list[int], max_tokens: int) -> list[float]:
    """Arrival times (seconds from sending) of each streamed token of one completion."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    start, times = time.perf_counter(), []
    with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter() - start)
    return times


def measure(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    rows = {"cold": [], "right_after": [], "settled": [], "decode_step": []}
    with httpx.Client(timeout=600) as http:
        stream(http, url, [rng.randrange(1000, 20000) for _ in range(64)], 2)  # warm
        for _ in range(args.reps):
            ids = [rng.randrange(1000, 20000) for _ in range(args.tokens)]
            rows["cold"].append(stream(http, url, ids, 1)[0])
            rows["right_after"].append(stream(http, url, ids, 1)[0])
            time.sleep(args.settle)
            rows["settled"].append(stream(http, url, ids, 1)[0])
            fresh = [rng.randrange(1000, 20000) for _ in range(args.tokens)]
            times = stream(http, url, fresh, 33)
            rows["decode_step"].append(statistics.median(b - a for a, b in zip(times, times[1:])))
    result = {k: statistics.median(v) for k, v in rows.items()}
    step = result["decode_step"]
    result["ratios"] = {k: result[k] / step for k in ("cold", "right_after", "settled")}
    result["rows"] = rows
    result["tokens"] = args.tokens
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    if args.url:
        result = measure(args.url, args)
    else:
        from kvwise.bench.common import serve_process
        from kvwise.bench.llamacpp import free_port

        port = free_port()
        with tempfile.TemporaryDirectory() as disk:
            cmd = [sys.executable, "-m", "kvwise.cli", "serve", "--port", str(port),
                   "--kv-disk-path", disk]  # fmt: skip

            async def work(url: str) -> dict:
                return measure(url, args)

            result = serve_process(cmd, f"http://127.0.0.1:{port}", work, timeout=300)
    for k in ("cold", "right_after", "settled", "decode_step"):
        ratio = result["ratios"].get(k)
        print(f"{k:12s} {result[k] * 1e3:8.1f} ms" + (f"  {ratio:.2f} steps" if ratio else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
