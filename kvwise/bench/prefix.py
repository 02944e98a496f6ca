"""``kvwise bench prefix``: what prefix caching buys and what it costs, in one run.

- TTFT of a request whose ``--prefix-len``-token prefix is cached vs the same request cold
  (cold = a fresh cache salt, so nothing can hit);
- throughput with prefix caching on vs off on a workload with no shared prefixes (two engines
  over the same weights, interleaved), plus the bookkeeping time measured directly;
- KV memory utilisation (tokens held / capacity of the blocks holding them), sampled at
  every step of a mixed workload.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tqdm import tqdm

from kvwise.bench.common import median, run_to_completion
from kvwise.bench.progress import bar
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine, load_for
from kvwise.types import SamplingParams


class _Timed:
    """Wrap a method and add up the seconds spent in it."""

    def __init__(self, obj, name: str) -> None:
        self.fn = getattr(obj, name)
        self.seconds = 0.0
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def _result(args, runs: tuple, utilization: list[float], preemptions: int) -> dict:
    """The JSON record: medians of the per-rep figures, the pool's utilization."""
    cold, warm, rate_on, rate_off, bookkeeping = runs
    return {
        "reps": args.reps,
        "prefix_len": args.prefix_len,
        "ttft_cold_s": median(cold),
        "ttft_cached_s": median(warm),
        "ttft_speedup": median(cold) / median(warm),
        "throughput_on": median(rate_on),
        "throughput_off": median(rate_off),
        "on_vs_off": median(rate_on) / median(rate_off),
        "bookkeeping_share": median(bookkeeping),
        "kv_utilization_mean": sum(utilization) / len(utilization),
        "kv_utilization_min": min(utilization),
        "kv_utilization_steps": len(utilization),
        "preemptions_in_mixed": preemptions,
        "all": {"cold": cold, "warm": warm, "on": rate_on, "off": rate_off},
    }


def main(args: argparse.Namespace) -> int:
    kw = _engine_kwargs(args)
    loaded = load_for(EngineConfig.from_kwargs(**kw))
    on = build_engine(EngineConfig.from_kwargs(**kw), loaded=loaded)
    off = build_engine(
        EngineConfig.from_kwargs(**{**kw, "enable_prefix_caching": False}),
        loaded=loaded,
        progress=False,
    )
    rng = random.Random(0)
    vocab = loaded.arch.vocab_size

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefix = rand(args.prefix_len)
    no_share = [rand(rng.randint(64, 512)) for _ in range(16)]
    no_share_params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    mixed = [rand(rng.randint(100, 1000)) for _ in range(24)]
    mixed_params = [
        SamplingParams(max_tokens=rng.randint(16, 128), temperature=0, ignore_eos=True)
        for _ in mixed
    ]

    timers = [
        _Timed(on.kv_manager, "get_computed_blocks"),
        _Timed(on.kv_manager, "cache_full_blocks"),
    ]
    cold, warm, rate_on, rate_off, bookkeeping = [], [], [], [], []
    run_to_completion(on, [prefix + rand(16)], one)  # warm-up
    for rep in tqdm(range(args.reps), desc="bench prefix", unit="rep"):
        salt = f"rep{rep}"
        (c,), _ = run_to_completion(
            on, [prefix + rand(16)], one, cache_salt=salt
        )  # cold, then cached
        (w,), _ = run_to_completion(on, [prefix + rand(16)], one, cache_salt=salt)
        assert w.num_cached_tokens == args.prefix_len, w.num_cached_tokens
        cold.append(c.metrics.ttft)
        warm.append(w.metrics.ttft)
        fresh = [[10 + rep] + p for p in no_share]  # never seen before: a 0% hit rate
        _no_share_rates(
            on, off, rep, fresh, no_share_params, timers, rate_on, rate_off, bookkeeping
        )
    utilization, preemptions = _utilization(kw, loaded, mixed, mixed_params)
    result = _result(args, (cold, warm, rate_on, rate_off, bookkeeping), utilization, preemptions)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(_table(result))
    return 0


def _no_share_rates(on, off, rep, fresh, params, timers, rate_on, rate_off, bookkeeping) -> None:
    """One rep of the no-shared-prefix throughput, caching on and off (each engine's rate
    appended to its list; the on engine's bookkeeping share of the wall time too)."""
    # alternate which engine goes first, so drift in the machine's speed cancels out
    for engine in (on, off) if rep % 2 == 0 else (off, on):
        for t in timers:
            t.seconds = 0.0
        outs, wall = run_to_completion(engine, fresh, params)
        assert sum(o.num_cached_tokens for o in outs) == 0
        rate = sum(len(o.token_ids) for o in outs) / wall
        if engine is on:
            rate_on.append(rate)
            bookkeeping.append(sum(t.seconds for t in timers) / wall)
        else:
            rate_off.append(rate)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The engines' settings: a prefill chunk that takes the whole prefix, the device pool only."""
    from kvwise.cli.engine_args import engine_kwargs

    kw = engine_kwargs(args)
    kw["prefill_chunk_size"] = max(kw["prefill_chunk_size"], args.prefix_len + 64)
    kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], kw["prefill_chunk_size"])
    kw.setdefault("kv_cache_memory", None)
    kw["kv_cache_memory"] = kw["kv_cache_memory"] or "1GiB"
    kw.update(kv_host_memory="off", kv_disk_path="off", kv_redis_url=None)  # the device pool only
    return kw


def _table(r: dict) -> str:
    """The figures as a Markdown table, with the targets they are held to."""
    return (
        f"| figure | value | target |\n|---|---:|---|\n"
        f"| TTFT, {r['prefix_len']}-token prefix cold | {r['ttft_cold_s'] * 1000:.0f} ms | |\n"
        f"| TTFT, same prefix cached | {r['ttft_cached_s'] * 1000:.1f} ms | |\n"
        f"| speedup | {r['ttft_speedup']:.1f}x | >= 30x |\n"
        f"| throughput, no shared prefixes, caching on | {r['throughput_on']:.1f} tok/s | |\n"
        f"| same, caching off | {r['throughput_off']:.1f} tok/s | |\n"
        f"| on / off | {r['on_vs_off']:.3f} | overhead <= 2% |\n"
        f"| prefix-cache bookkeeping, share of wall time | {r['bookkeeping_share'] * 100:.2f}% | |\n"
        f"| KV memory utilisation, mixed workload (mean / min over {r['kv_utilization_steps']} "
        f"steps) | {r['kv_utilization_mean'] * 100:.1f}% / {r['kv_utilization_min'] * 100:.1f}% "
        f"| >= 95% |"
    )


def _utilization(kw: dict, loaded, prompts: list, params: list) -> tuple[list[float], int]:
    """KV utilisation at every step with requests running, on a 128 MiB pool the mixed
    prompts overflow; and the preemptions that took."""
    engine = build_engine(
        EngineConfig.from_kwargs(**{**kw, "kv_cache_memory": "128MiB"}),
        loaded=loaded,
        progress=False,
    )
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    utilization = []
    with bar(len(prompts), "pool utilisation, mixed load", "request") as progress:
        while engine.has_unfinished():
            progress.update(sum(out.finished for out in engine.step()))
            if engine.scheduler.running:
                utilization.append(engine.stats().kv.utilization)
    return utilization, engine.scheduler.num_preemptions
