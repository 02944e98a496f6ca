"""Where a cold 2,048-token disk hit spends its time: the loader's reads per layer group and
the model's step, as a timeline (ms from the start of the step), next to a plain decode
step's cost at short and long context.

    .venv/bin/python scripts/profile_tier_hit.py [--layer-groups 1] [--tokens 2048] [--runs 5]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from kvwise.bench.breakeven import _cold, _ttft
from kvwise.config import EngineConfig
from kvwise.engine import kv_loader
from kvwise.engine.builder import build_engine
from kvwise.models.loader import load_model
from kvwise.types import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer-groups", type=int, default=1)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    loaded = load_model(None, dtype=torch.float32, progress=False)
    config = EngineConfig.from_kwargs(
        kv_cache_memory="1GiB",
        kv_host_memory="off",
        kv_disk_path=tempfile.mkdtemp(prefix="kvwise-profile-"),
        kv_store_min_tokens=16,
        kv_load_policy="always",
        kv_layer_groups=args.layer_groups,
    )
    engine = build_engine(config, progress=False, loaded=loaded)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.tokens + 1)]
    print(f"first run, computed (includes warm-up): {_ttft(engine, prompt)[0] * 1e3:.0f} ms")

    marks: list[tuple[str, float, float]] = []
    step_start = [0.0]
    read_group = engine.store.read_group

    def timed_read(chunks, group, dest=None):
        t = time.perf_counter()
        out = read_group(chunks, group, dest)
        marks.append((f"read g{group}", t - step_start[0], time.perf_counter() - step_start[0]))
        return out

    engine.store.read_group = timed_read
    wait_layer = kv_loader.KVLoader.wait_layer

    def timed_wait(self, layer):
        t = time.perf_counter()
        wait_layer(self, layer)
        if time.perf_counter() - t > 1e-3:
            marks.append((f"wait L{layer}", t - step_start[0], time.perf_counter() - step_start[0]))

    kv_loader.KVLoader.wait_layer = timed_wait
    execute = engine.runner.execute

    def timed_execute(*a, **kw):
        step_start[0] = time.perf_counter()
        out = execute(*a, **kw)
        marks.append(("step", 0.0, time.perf_counter() - step_start[0]))
        return out

    engine.runner.execute = timed_execute
    for _ in range(args.runs):
        _cold(engine)
        marks.clear()
        seconds, out = _ttft(engine, prompt)
        assert out.num_loaded_tokens == args.tokens
        timeline = " ".join(f"{n} {a * 1e3:.0f}-{b * 1e3:.0f}" for n, a, b in sorted(marks))
        print(f"cold disk hit TTFT {seconds * 1e3:.0f} ms | {timeline}")
    engine.runner.execute = execute
    for n in (16, args.tokens):
        engine.add_request(
            [rng.randrange(100, 49000) for _ in range(n)],
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        )
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    gaps = sorted(o.metrics.inter_token_times)
                    print(
                        f"decode step at {n} tokens of context: {gaps[len(gaps) // 2] * 1e3:.0f} ms"
                    )
    engine.close()


if __name__ == "__main__":
    main()
