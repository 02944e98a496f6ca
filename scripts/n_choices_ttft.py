"""n choices of one prompt cost one prefill: TTFT and pool blocks of n=4 vs n=1, interleaved.

  python scripts/n_choices_ttft.py [--model M] [--tokens 1024] [--rounds 5] [--n 4] [--json OUT]

Each round, cold (the pool's prefix cache emptied first): one request, then n copies of the
same prompt added at once (what the server does for ``n``); TTFT is the time until every
choice has its first token; the peak of the pool's used blocks is read after every step. A
benchmark tool: nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvwise import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)


def _round(engine, prompt: list[int], n: int) -> tuple[float, int]:
    engine.kv_manager.pool.reset_prefix_cache()
    start = time.perf_counter()
    ids = [engine.add_request(prompt, PARAMS) for _ in range(n)]
    first: dict[str, float] = {}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
        peak = max(peak, engine.kv_manager.pool.num_used_blocks)
    return max(first[i] for i in ids) - start, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llm = LLM(model=args.model, kv_cache_memory="512MiB", kv_host_memory="off",
              kv_disk_path="off", progress=False)  # fmt: skip
    engine = llm.engine
    words = " ".join(f"item {i} is {['red', 'blue', 'green'][i % 3]}." for i in range(2000))
    prompt = engine.tokenize(words)[: args.tokens]
    _round(engine, prompt, 1)  # warm up
    one, many = [], []
    for _ in range(args.rounds):
        one.append(_round(engine, prompt, 1))
        many.append(_round(engine, prompt, args.n))
    t1, tn = statistics.median(t for t, _ in one), statistics.median(t for t, _ in many)
    result = {"prompt_tokens": len(prompt), "n": args.n, "block_size": engine.kv_manager.block_size,
              "ttft_n1_s": round(t1, 4), f"ttft_n{args.n}_s": round(tn, 4),
              "ratio": round(tn / t1, 3), "peak_blocks_n1": one[0][1],
              f"peak_blocks_n{args.n}": many[0][1], "rounds_n1": one, f"rounds_n{args.n}": many,
              "prefill_waits": engine.scheduler.num_prefill_waits}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
