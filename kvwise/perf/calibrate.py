"""``kvwise breakeven --calibrate``: measure this machine for ``--hardware this-machine``.

Every parameter of the roofline (``roofline.py``) is measured here, none chosen to match
``kvwise bench breakeven``'s curves, and at other lengths than the ones they are checked at
(256, 1,024 and 4,096 tokens):

- **peak FLOP/s**: the best run of float32 matmuls shaped like the model's, at the engine's
  thread count; **memory bandwidth**: the best run of summing a 512 MiB tensor (peaks, as
  STREAM reports them: a busy moment can only make a run slower).
- **step overhead, mfu, attention fraction**: least squares of ``o + linear FLOPs/(mfu·peak)
  + attention FLOPs/(af·peak)`` over the engine's own prefill steps for prompts of 64, 192,
  512 and 2,560 tokens (chunks at contexts 0 to 2,048); decode steps are reported as a check.
- **each tier**: the time the model waited for its loads (read, check and copy into the pool;
  cold page cache for disk) for stored prefixes of 64, 512 and 2,560 tokens, fitted as
  ``latency + bytes / bandwidth`` over the prefix's KV bytes.
- **request overhead**: the median of TTFT minus the steps' time.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

STEP_LENGTHS = (64, 192, 512, 2560)
TIER_LENGTHS = (64, 512, 2560)


def _peak_flops(hidden: int, inter: int) -> float:
    import torch

    best = 0.0
    for m, k, n in ((512, hidden, inter), (512, inter, hidden), (512, hidden, hidden)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(3):
            a @ b
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
        best = max(best, 2 * m * k * n / min(ts))
    return best


def _timed_request(engine, token_ids: list[int], max_tokens: int):
    """Run one request alone; return (TTFT, the steps' seconds in order)."""
    from kvwise.types import SamplingParams

    t0 = time.perf_counter()
    rid = engine.add_request(token_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    steps, ttft = [], None
    while True:
        s0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - s0)
        for out in outs:
            if out.request_id == rid and ttft is None:
                ttft = time.perf_counter() - t0
            if out.request_id == rid and out.finished:
                return ttft, steps


def calibrate(args: argparse.Namespace, path: Path) -> dict:
    """Measure, fit, write the calibration to ``path``; return what was measured."""
    import torch

    from kvwise.bench.common import measure_read_bandwidth
    from kvwise.models.loader import load_model
    from kvwise.perf.model_shape import ModelShape
    from kvwise.perf.roofline import Hardware, Roofline, save_machine
    from kvwise.perf.roofline_fit import fit_steps, step_check

    if args.reps < 1:
        raise ValueError("reps: must be at least 1")
    tiers = [t for t in (args.tiers or "host,disk,redis").split(",") if t]
    bad = [t for t in tiers if t not in ("host", "disk", "redis")]
    if bad:
        raise ValueError(f"tiers: --calibrate measures host, disk and/or redis, got {bad}")
    # float32 weights, as `kvwise bench breakeven` loads them
    loaded = load_model(
        args.model if args.model != "default" else None, dtype=torch.float32, progress=True
    )
    model = ModelShape.from_arch(
        loaded.arch, "the default model" if args.model == "default" else str(args.model)
    )
    print(f"torch threads: {torch.get_num_threads()}")
    peak = _peak_flops(model.hidden_size, model.intermediate_size)
    mem_bw = measure_read_bandwidth(512 * 2**20, reps=10, best=True)
    print(f"float32 matmul: {peak / 1e9:.0f} GFLOP/s; memory read: {mem_bw / 1e9:.1f} GB/s")

    result, facts = _measure_engines(args, loaded, tiers, model)
    tier_fits = [_tier_fit(t, result) for t in tiers]
    draft = Hardware(
        "this machine",
        peak,
        mem_bw,
        None,
        request_overhead_s=statistics.median(result["request_overheads"]),
        weight_dtype="float32",
        kv_dtype=facts["kv_dtype"],
        prefill_chunk=facts["prefill_chunk"],
        tiers=tuple(tier_fits),
        source=f"measured by `kvwise breakeven --calibrate` ({torch.get_num_threads()} threads)",
    )
    hw = fit_steps(model, draft, result["prefill_steps"], result["decode_steps"])
    check = step_check(model, hw, result["prefill_steps"], result["decode_steps"])
    measured = {
        **result,
        "model": args.model,
        "engine_weight_bytes": facts["weight_bytes"],
        "shape_weight_bytes": Roofline(model, hw).weight_bytes,
        "step_check": check,
    }
    save_machine(path, hw, measured)
    print_fit(hw, check)
    print(f"calibration: {path}")
    return measured


def _measure_engines(args, loaded, tiers: list[str], model) -> tuple[dict, dict]:
    """Build the engines `kvwise bench breakeven` builds by default (one without tiers, one per
    tier; Redis started on loopback), measure them, close them. Returns what was measured and
    the engine's facts the fit needs."""
    from kvwise.bench import breakeven as be
    from kvwise.cli.engine_args import add_engine_args

    redis_server = None
    if "redis" in tiers:
        try:
            redis_server = be._Redis()
        except FileNotFoundError:
            print("redis-server not found: skipping the redis tier")
            tiers.remove("redis")
    disk_root = tempfile.mkdtemp(prefix="kvwise-calibrate-")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args([])
    ns.model = None if args.model == "default" else args.model
    engines = {}
    try:
        engines = be._engines(
            ns,
            loaded,
            tiers,
            redis_server.url if redis_server else None,
            disk_root,
            max(STEP_LENGTHS) + 64,
        )
        result = _measure(args, engines, tiers, model)
        engine = engines["recompute"]
        facts = {
            "weight_bytes": sum(
                p.numel() * p.element_size() for p in engine.runner.model.parameters()
            ),
            "kv_dtype": engine.runner.spec.dtype,
            "prefill_chunk": engine.scheduler.config.prefill_chunk_size,
        }
    finally:
        for e in engines.values():
            e.close()
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(disk_root, ignore_errors=True)
    return result, facts


def print_fit(hw, step_check: list[dict]) -> None:
    print(
        f"step: {hw.step_overhead_s * 1e3:.1f} ms (+{hw.prefill_overhead_s * 1e3:.1f} ms a "
        f"prefill step) + matmuls at {hw.mfu:.2f} of peak + "
        f"attention at {hw.attn_fraction:.2f} ({'overlapped with' if hw.memory_overlap else 'after'}"
        " the memory time)"
    )
    print(f"request overhead: {hw.request_overhead_s * 1e3:.1f} ms")
    for t in hw.tiers:
        print(f"{t.name}: {t.latency_s * 1e3:.2f} ms + bytes / {t.bandwidth / 1e9:.2f} GB/s")
    for d in step_check:
        print(
            f"fit, a step of {d['tokens']} tokens after {d['context']:,}: measured "
            f"{d['measured_s'] * 1e3:.1f} ms, fitted {d['predicted_s'] * 1e3:.1f} ms"
        )


class _TimedLoader:
    """Installs a ``KVLoader`` that records its own time (reading, checking and copying every
    layer group in) as ``last``, for the duration of a ``with``."""

    def __enter__(self):
        from kvwise.engine import llm_engine

        timer = self
        self.last: float | None = None
        self._module, self._original = llm_engine, llm_engine.KVLoader

        class Timed(llm_engine.KVLoader):
            def _run(self) -> None:
                t0 = time.perf_counter()
                super()._run()
                timer.last = time.perf_counter() - t0

        llm_engine.KVLoader = Timed
        return self

    def __exit__(self, *exc) -> None:
        self._module.KVLoader = self._original


def _measure(args, engines, tiers, model) -> dict:
    from kvwise.bench import breakeven as be

    rng = random.Random(2)
    vocab = model.vocab_size
    engine = engines["recompute"]
    chunk = engine.scheduler.config.prefill_chunk_size or max(STEP_LENGTHS)
    be._ttft(engine, be._prompt(rng, vocab, 300))  # warm-up
    steps: dict[tuple[int, int], list[float]] = {}
    decode: dict[int, list[float]] = {}
    overheads = []
    stored = {(t, n): be._prompt(rng, vocab, n + 1) for t in tiers for n in TIER_LENGTHS}
    for t in tiers:
        for n in TIER_LENGTHS:
            be._ttft(engines[t], stored[(t, n)])
        engines[t].flush()  # the writes done: no writer thread competes with what is timed
    waits: dict[str, list[tuple[float, float]]] = {t: [] for t in tiers}
    load_overheads: dict[str, list[float]] = {t: [] for t in tiers}
    total = args.reps * (len(STEP_LENGTHS) + len(tiers) * len(TIER_LENGTHS))
    with _TimedLoader() as loader, tqdm(total=total, desc="calibrate", unit="run") as bar:
        for _ in range(args.reps):
            for n in STEP_LENGTHS:
                ttft, times = _timed_request(engine, be._prompt(rng, vocab, n), 4)
                chunks = [(s, min(chunk, n - s)) for s in range(0, n, chunk)]
                for (s, q), sec in zip(chunks, times):
                    steps.setdefault((q, s), []).append(sec)
                decode.setdefault(n, []).extend(times[len(chunks) :])
                overheads.append(ttft - sum(times[: len(chunks)]))
                bar.update()
            for t in tiers:
                for n in TIER_LENGTHS:
                    wait, extra = _tier_load(engines[t], stored[(t, n)], n, loader)
                    waits[t].append((n * engines[t].runner.spec.bytes_per_token, wait))
                    load_overheads[t].append(extra)
                    bar.update()
    return {
        "reps": args.reps,
        "prefill_steps": [(q, c, statistics.median(v)) for (q, c), v in sorted(steps.items())],
        "decode_steps": [(n + 1, statistics.median(v)) for n, v in sorted(decode.items())],
        "request_overheads": overheads,
        "tier_reads": {t: _medians(v) for t, v in waits.items()},
        "load_overheads": load_overheads,
    }


def _tier_load(engine, prompt: list[int], n: int, loader: _TimedLoader) -> tuple[float, float]:
    """A forced, cold load of ``prompt``'s stored ``n``-token prefix: (the loader's time, the
    load path's overhead). The same prompt again, its prefix now in the device pool, gives
    the last token's forward as the engine runs it; what the load's TTFT costs beyond that and
    the loader's own time is the load path's overhead (planning, the loader thread)."""
    from kvwise.bench import breakeven as be

    engine.store.policy = "always"
    be._cold(engine)
    loader.last = None
    ttft, out = be._ttft(engine, prompt)
    if out.num_loaded_tokens != n or loader.last is None:
        raise RuntimeError(f"loaded {out.num_loaded_tokens} of {n} tokens")
    hit, out = be._ttft(engine, prompt)
    if out.num_cached_tokens != n:
        raise RuntimeError(f"{out.num_cached_tokens} of {n} tokens cached")
    return loader.last, ttft - loader.last - hit


def _tier_fit(name: str, result: dict):
    """A tier as a request sees it: the loader's time (reads, checks, copies) fitted as
    latency + bytes / bandwidth, plus the load path's own overhead (median)."""
    from kvwise.perf.roofline import Tier
    from kvwise.perf.roofline_fit import fit_tier

    fit = fit_tier(name, result["tier_reads"][name], "")
    extra = max(0.0, statistics.median(result["load_overheads"][name]))
    lengths = ", ".join(map(str, TIER_LENGTHS))
    return Tier(
        name,
        fit.latency_s + extra,
        fit.bandwidth,
        f"measured here at {lengths} tokens: the loader's reads, checks and copies "
        f"{fit.latency_s * 1e3:.2f} ms + bytes / {fit.bandwidth / 1e9:.2f} GB/s, and the load "
        f"path's overhead {extra * 1e3:.2f} ms",
    )


def _medians(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The median ``y`` of each distinct ``x``."""
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(x, []).append(y)
    return [(x, statistics.median(ys)) for x, ys in sorted(by_x.items())]
