"""Cold 2,048-token disk hit TTFT (page cache dropped before each run, loads forced) of
whichever kvwise is on PYTHONPATH: the median of ``--runs`` after one computed run. For A/B
runs of two checkouts, each in its own process, interleaved by the caller::

    for i in 1 2 3 4 5; do
      PYTHONPATH=. .venv/bin/python scripts/ab_disk_hit.py sealed
      PYTHONPATH=/tmp/kvwise-crc .venv/bin/python scripts/ab_disk_hit.py crc32
    done
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile

from kvwise.bench.breakeven import _cold, _ttft
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine


def main(label: str, runs: int = 5, tokens: int = 2048) -> None:
    config = EngineConfig.from_kwargs(
        kv_cache_memory="1GiB",
        kv_host_memory="off",
        kv_disk_path=tempfile.mkdtemp(prefix="kvwise-ab-"),
        kv_store_min_tokens=16,
        kv_load_policy="always",
    )
    engine = build_engine(config, progress=False)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(tokens + 1)]
    _ttft(engine, prompt)  # computed and stored
    times = []
    for _ in range(runs):
        _cold(engine)
        seconds, out = _ttft(engine, prompt)
        assert out.num_loaded_tokens == tokens, out.num_loaded_tokens
        times.append(seconds * 1e3)
    engine.close()
    spread = " ".join(f"{t:.0f}" for t in times)
    print(f"{label}: cold disk hit {statistics.median(times):.1f} ms (runs: {spread})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this checkout")
