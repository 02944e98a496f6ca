"""``kvwise bench breakeven``: TTFT against prefix length, recompute vs a hit from each tier.

For each prefix length ``L`` (a prompt of ``L + 1`` tokens whose first ``L`` are stored) and
each repetition, interleaved so that machine noise hits every column alike:

- **recompute**: a fresh prompt on an engine without tiers (cold device pool);
- **<tier> load**: the stored prompt on an engine with only that tier, the device pool
  emptied (and, for disk, the files dropped from the page cache), loads forced;
- **<tier> auto**: the same with the cost model deciding between loading and recomputing.

Reports medians, each tier's break-even length (where loading starts to win, interpolated on
the measured points), the disk tier's speed-up at 2,048 tokens with a cold page cache, and
whether the cost model's choice stayed within 10% of the better of load and recompute at
every length. Draws TTFT against length as a PNG. ``--chunk-blocks 1,4,8,16`` instead compares
entry sizes on the disk tier. ``--kv-formats float32,int8,int4`` measures each KV format in
turn (its own engines: a stored entry is in the format of the pool) and draws them on one
figure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvwise.bench.common import median
from kvwise.bench.progress import phase


class _Redis:
    """A throwaway redis-server on a free loopback port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="kvwise-bench-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            + ["--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _ttft(engine, token_ids: list[int]):
    from kvwise.types import SamplingParams

    t0 = time.perf_counter()
    request_id = engine.add_request(token_ids, SamplingParams(max_tokens=1, temperature=0))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return time.perf_counter() - t0, out


def _cold(engine) -> None:
    """Empty the device pool's cached prefixes and drop disk entries from the page cache."""
    engine.flush()
    engine.kv_manager.pool.reset_prefix_cache()
    for tier in engine.store.tiers if engine.store else ():
        drop_page_cache = getattr(tier, "drop_page_cache", None)  # tiers backed by files
        if drop_page_cache is not None:
            drop_page_cache()


def _break_even(lengths: list[int], recompute: list[float], load: list[float]) -> float | None:
    """The prefix length where loading starts to beat recomputing (log-interpolated)."""
    if load[0] < recompute[0]:
        return 0.0  # loading wins from the shortest measured length on
    for i in range(1, len(lengths)):
        d0, d1 = load[i - 1] - recompute[i - 1], load[i] - recompute[i]
        if d0 >= 0 > d1:
            f = d0 / (d0 - d1)
            return math.exp(math.log(lengths[i - 1]) + f * math.log(lengths[i] / lengths[i - 1]))
    return None  # never within the measured lengths


def _engines(
    args,
    loaded,
    tiers: list[str],
    redis_url: str | None,
    disk_root: str,
    max_len: int,
    kv_dtype: str | None = None,
):
    from kvwise.cli.engine_args import engine_kwargs
    from kvwise.config import EngineConfig
    from kvwise.engine.builder import build_engine
    from kvwise.engine.llm_engine import LLMEngine

    kw = engine_kwargs(args)
    if kv_dtype:
        kw["kv_cache_dtype"] = kv_dtype
        disk_root = f"{disk_root}/{kv_dtype}"
    kw["kv_cache_memory"] = kw.get("kv_cache_memory") or "1GiB"
    kw["prefill_chunk_size"] = kw.get("prefill_chunk_size") or 512
    off = {"kv_host_memory": "off", "kv_disk_path": "off", "kv_redis_url": None}
    min_tokens = kw.get("block_size") or 16  # store everything measured
    base = {**kw, **off, "kv_store_min_tokens": min_tokens, "max_model_len": max(max_len, 300) + 64}

    def make(**extra) -> LLMEngine:
        config = EngineConfig.from_kwargs(**{**base, **extra})
        return build_engine(config, progress=False, loaded=loaded)

    engines = {"recompute": make()}
    for tier in tiers:
        if tier == "host":
            engines[tier] = make(kv_host_memory="4GiB")
        elif tier == "disk":
            engines[tier] = make(kv_disk_path=f"{disk_root}/{tier}", kv_disk_size="8GiB")
        else:
            secret = kw.get("kv_store_secret") or secrets.token_hex(32)
            engines[tier] = make(
                kv_redis_url=redis_url, kv_redis_timeout=5.0, kv_store_secret=secret
            )
    return engines


def main(args: argparse.Namespace) -> int:
    import torch

    from kvwise.models.loader import load_model

    lengths = sorted({int(x) for x in args.lengths.split(",")})
    tiers = [t for t in args.tiers.split(",") if t]
    bad = [t for t in tiers if t not in ("host", "disk", "redis")]
    block_size = args.block_size or 16
    if bad:
        raise ValueError(f"tiers: expected host, disk and/or redis, got {bad}")
    if args.reps < 1:
        raise ValueError("reps: must be at least 1")
    if not lengths or any(n <= 0 or n % block_size for n in lengths):
        raise ValueError(f"lengths: must be positive multiples of the block size ({block_size})")
    redis_server = None
    redis_url = args.redis_url
    if "redis" in tiers and redis_url is None:
        try:
            redis_server = _Redis()
            redis_url = redis_server.url
        except FileNotFoundError:
            print("redis-server not found: skipping the redis tier")
            tiers.remove("redis")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    loaded = load_model(args.model, dtype=dtype[args.dtype], progress=True)
    disk_root = tempfile.mkdtemp(prefix="kvwise-bench-disk-")
    try:
        if args.chunk_blocks:
            result = _compare_chunks(args, loaded, lengths, disk_root)
        elif args.kv_formats:
            result = _compare_formats(args, loaded, tiers, redis_url, disk_root, lengths)
        else:
            engines = _engines(args, loaded, tiers, redis_url, disk_root, lengths[-1])
            result = _measure(args, engines, tiers, lengths)
            for engine in engines.values():
                engine.close()
    finally:
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(disk_root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _compare_formats(args, loaded, tiers, redis_url, disk_root: str, lengths: list[int]) -> dict:
    from kvwise.core.kv_spec import kv_formats

    formats = [f for f in args.kv_formats.split(",") if f]
    bad = [f for f in formats if f not in kv_formats()]
    if bad or not formats:
        raise ValueError(f"kv_formats: expected some of {kv_formats()}, got {args.kv_formats!r}")
    plot, args.plot = args.plot, None
    results = {}
    try:
        for fmt in formats:
            print(f"\n== KV format {fmt} ==")
            engines = _engines(args, loaded, tiers, redis_url, disk_root, lengths[-1], fmt)
            try:
                results[fmt] = _measure(args, engines, tiers, lengths)
                spec = engines["recompute"].runner.spec
                results[fmt]["bytes_per_token"] = spec.bytes_per_token
            finally:
                for engine in engines.values():
                    engine.close()
    finally:
        args.plot = plot
    if plot:
        _plot_formats(plot, lengths, results, tiers)
        print(f"plot: {plot}")
    return {"kv_formats": results}


def _plot_formats(path: str, lengths, results: dict, tiers: list[str]) -> None:
    """Recompute and each tier's load against prefix length, one colour per KV format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = {"host": "-s", "disk": "-o", "redis": "-^"}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (fmt, result) in enumerate(results.items()):
        c = colours[i % len(colours)]
        med = result["median_ttft_s"]
        ax.plot(
            lengths,
            [s * 1e3 for s in med["recompute"]],
            ":",
            color=c,
            lw=1.5,
            label=f"{fmt}: recompute",
        )
        for t in tiers:
            ax.plot(
                lengths,
                [s * 1e3 for s in med[f"{t} load"]],
                styles[t],
                color=c,
                ms=4,
                label=f"{fmt}: {t} load",
            )
    _finish_ttft_plot(
        fig,
        ax,
        path,
        "kvwise: loading a stored prefix vs recomputing it, per KV format",
        legend={"fontsize": 7, "ncol": 2},
    )


def _finish_ttft_plot(fig, ax, path: str, title: str, legend: dict) -> None:
    """Log axes, labels, grid and legend of a TTFT-vs-prefix-length plot; write the PNG."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time to first token (ms, median)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**legend)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _prompt(rng: random.Random, vocab: int, num_tokens: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(num_tokens)]


def _measure(args, engines, tiers: list[str], lengths: list[int]) -> dict:
    rng = random.Random(0)
    vocab = engines["recompute"].runner.vocab_size
    # one stored prompt per (tier, length): computed once, written down, then loaded each rep
    stored = {(t, n): _prompt(rng, vocab, n + 1) for t in tiers for n in lengths}
    samples: dict[str, dict[int, list[float]]] = {"recompute": {n: [] for n in lengths}}
    for tier in tiers:
        samples[f"{tier} load"] = {n: [] for n in lengths}
        samples[f"{tier} auto"] = {n: [] for n in lengths}
    chosen: dict[str, dict[int, list[int]]] = {t: {n: [] for n in lengths} for t in tiers}
    warm = _prompt(rng, vocab, 300)
    with phase("warm-up, and the prompts written to the tiers"):
        for engine in engines.values():  # and the cost model's first observations
            _ttft(engine, warm)
        for tier in tiers:
            for n in lengths:
                _ttft(engines[tier], stored[(tier, n)])
            engines[tier].flush()  # the writes done: no writer thread competes with the timing
    total = args.reps * len(lengths) * (1 + 2 * len(tiers))
    with tqdm(total=total, desc="bench breakeven", unit="run") as bar:
        for _ in range(args.reps):
            for n in lengths:
                seconds, _ = _ttft(engines["recompute"], _prompt(rng, vocab, n + 1))
                samples["recompute"][n].append(seconds)
                bar.update()
                for tier in tiers:
                    _time_tier(engines[tier], tier, n, stored[(tier, n)], samples, chosen[tier])
                    bar.update(2)
    med = {k: [median(v[n]) for n in lengths] for k, v in samples.items()}
    report = {
        "lengths": lengths,
        "reps": args.reps,
        "median_ttft_s": med,
        "samples_s": {k: {str(n): v[n] for n in lengths} for k, v in samples.items()},
        "auto_loaded_tokens": {t: {str(n): chosen[t][n] for n in lengths} for t in tiers},
        "break_even_tokens": {},
        "cost_model_within_10pct": {},
        "auto_run_within_10pct": {},
        "cost_model": engines[tiers[0]].store.cost.snapshot() if tiers else {},
    }
    _print_table(args.reps, lengths, med, tiers)
    for t in tiers:
        _judge_tier(report, t, lengths, med, samples, chosen[t])
    if "disk" in tiers and 2048 in lengths:
        i = lengths.index(2048)
        speedup = med["recompute"][i] / med["disk load"][i]
        report["disk_2048_cold_speedup"] = speedup
        print(
            f"disk tier, 2,048-token prefix, cold page cache: {speedup:.1f}x faster than recompute"
        )
    if args.plot:
        _plot(args.plot, lengths, med, tiers, report["break_even_tokens"])
        print(f"plot: {args.plot}")
    return report


def _time_tier(engine, tier: str, n: int, prompt, samples: dict, chosen: dict) -> None:
    """One timed load of a stored ``n``-token prompt per policy: ``always`` loads every stored
    token (checked), ``auto`` loads what the cost model chooses (recorded in ``chosen``)."""
    for policy in ("always", "auto"):
        engine.store.policy = policy
        _cold(engine)
        seconds, out = _ttft(engine, prompt)
        if policy == "always" and out.num_loaded_tokens != n:
            raise RuntimeError(f"{tier}: loaded {out.num_loaded_tokens} of {n}")
        samples[f"{tier} {'load' if policy == 'always' else 'auto'}"][n].append(seconds)
        if policy == "auto":
            chosen[n].append(out.num_loaded_tokens)


def _print_table(reps: int, lengths: list[int], med: dict, tiers: list[str]) -> None:
    print(f"\nTTFT medians over {reps} reps (ms); prefix of L tokens + 1 computed token")
    header = f"{'L':>6} {'recompute':>10}" + "".join(
        f" {t + ' load':>11} {t + ' auto':>11} {'speed-up':>8}" for t in tiers
    )
    print(header)
    for i, n in enumerate(lengths):
        row = f"{n:>6} {med['recompute'][i] * 1e3:>10.1f}"
        for t in tiers:
            load, auto = med[f"{t} load"][i], med[f"{t} auto"][i]
            row += f" {load * 1e3:>11.1f} {auto * 1e3:>11.1f} {med['recompute'][i] / load:>7.1f}x"
        print(row)


def _judge_tier(report: dict, t: str, lengths: list[int], med: dict, samples: dict, chosen) -> None:
    """Tier ``t``'s break-even, and whether the cost model's choices cost within 10% of the
    better option at each length; into ``report``, and printed."""
    be = _break_even(lengths, med["recompute"], med[f"{t} load"])
    report["break_even_tokens"][t] = be
    ok, ok_raw = [], []
    for i, n in enumerate(lengths):
        best = min(med["recompute"][i], med[f"{t} load"][i])
        # the measured cost of what the model chose: the median of that option's column
        # (a partial load has no column: its own run stands for it)
        picked = [
            med[f"{t} load"][i]
            if loaded == n
            else med["recompute"][i]
            if loaded == 0
            else samples[f"{t} auto"][n][r]
            for r, loaded in enumerate(chosen[n])
        ]
        ok.append(median(picked) <= 1.10 * best)
        ok_raw.append(med[f"{t} auto"][i] <= 1.10 * best)
    report["cost_model_within_10pct"][t] = ok
    report["auto_run_within_10pct"][t] = ok_raw
    where = (
        "never (recompute wins at every measured length)"
        if be is None
        else ("below the shortest length measured" if be == 0 else f"~{be:.0f} tokens")
    )
    print(
        f"{t}: break-even {where}; the cost model's choices cost within 10% of the better "
        f"option at {sum(ok)}/{len(ok)} lengths (its own runs' medians: {sum(ok_raw)}/"
        f"{len(ok_raw)})"
    )


def _plot(path: str, lengths, med, tiers, break_even) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(lengths, [s * 1e3 for s in med["recompute"]], "k-o", label="recompute")
    colours = {"host": "tab:green", "disk": "tab:blue", "redis": "tab:red"}
    for t in tiers:
        c = colours[t]
        ax.plot(lengths, [s * 1e3 for s in med[f"{t} load"]], "-s", color=c, label=f"{t} load")
        ax.plot(
            lengths,
            [s * 1e3 for s in med[f"{t} auto"]],
            "x",
            color=c,
            ms=10,
            label=f"{t}: cost model's choice",
        )
        be = break_even.get(t)
        if be:
            ax.axvline(be, color=c, ls=":", lw=1)
    _finish_ttft_plot(
        fig, ax, path, "kvwise: loading a stored prefix vs recomputing it", legend={"fontsize": 8}
    )


def _compare_chunks(args, loaded, lengths: list[int], disk_root: str) -> dict:
    """Disk-tier TTFT (cold page cache) for each entry size, at each length."""
    from kvwise.cli.engine_args import engine_kwargs
    from kvwise.config import EngineConfig
    from kvwise.engine.builder import build_engine

    sizes = [int(x) for x in args.chunk_blocks.split(",")]
    kw = engine_kwargs(args)
    kw["kv_cache_memory"] = kw.get("kv_cache_memory") or "1GiB"
    engines = {}
    for c in sizes:
        config = EngineConfig.from_kwargs(
            **{
                **kw,
                "kv_host_memory": "off",
                "kv_redis_url": None,
                "kv_disk_path": f"{disk_root}/c{c}",
                "kv_chunk_blocks": c,
                "kv_store_min_tokens": 16,
                "kv_load_policy": "always",
                "max_model_len": lengths[-1] + 64,
            }
        )
        engines[c] = build_engine(config, progress=False, loaded=loaded)
    rng = random.Random(1)
    vocab = loaded.arch.vocab_size
    prompts = {n: _prompt(rng, vocab, n + 1) for n in lengths}
    for engine in engines.values():
        for n in lengths:
            _ttft(engine, prompts[n])
    samples = {c: {n: [] for n in lengths} for c in sizes}
    with tqdm(total=args.reps * len(sizes) * len(lengths), desc="chunk sizes", unit="run") as bar:
        for _ in range(args.reps):
            for n in lengths:
                for c in sizes:
                    _cold(engines[c])
                    seconds, out = _ttft(engines[c], prompts[n])
                    assert out.num_loaded_tokens == n
                    samples[c][n].append(seconds)
                    bar.update()
    print("\ndisk tier TTFT (ms, median, cold page cache) by entry size (blocks per entry)")
    print(f"{'L':>6}" + "".join(f" {f'{c} blocks':>10}" for c in sizes))
    for n in lengths:
        print(f"{n:>6}" + "".join(f" {median(samples[c][n]) * 1e3:>10.1f}" for c in sizes))
    for engine in engines.values():
        engine.close()
    return {
        "chunk_blocks": sizes,
        "samples_s": {str(c): {str(n): v for n, v in s.items()} for c, s in samples.items()},
    }
