"""Median time of one engine decode step for a single request, optionally with a torch
profile of 10 steps (the figures of the kernel work in docs/BENCHMARKS.md, issue 11)::

    .venv/bin/python scripts/decode_step_time.py --quantization auto --context 32 [--profile] \
        [--kv-cache-dtype int4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine
from kvwise.types import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", default="auto")
    p.add_argument("--context", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's format")
    p.add_argument("--profile", action="store_true", help="print a torch profile of 10 steps")
    args = p.parse_args()
    config = EngineConfig.from_kwargs(
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, kv_disk_path="off", kv_host_memory="off",
        kv_cache_memory="512MiB", enable_prefix_caching=False, prefill_chunk_size=2048,
        max_num_batched_tokens=2048,
    )  # fmt: skip
    engine = build_engine(config, progress=False)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.context)]
    engine.add_request(prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    for _ in range(20):  # the prefill and a warm-up
        engine.step()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(40):
            engine.step()
        rounds.append((time.perf_counter() - start) / 40 * 1000)
    print(f"{args.quantization}, context {args.context}: "
          f"{statistics.median(rounds):.2f} ms a step (median of 5 x 40 steps)")  # fmt: skip
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
