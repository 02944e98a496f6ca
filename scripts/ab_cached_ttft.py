"""Cached-prefix TTFT (2,048-token prefix + 16 new tokens) of whichever kvwise is on
PYTHONPATH, as the median of 9 repetitions after one cold run: a quick A/B of two checkouts,
each in its own process, interleaved by the caller::

    for i in 1 2 3; do
      PYTHONPATH=. .venv/bin/python scripts/ab_cached_ttft.py after
      PYTHONPATH=../old .venv/bin/python scripts/ab_cached_ttft.py before
    done

Works against the engine API from before and after the engine was assembled from parts.
"""

import random
import statistics
import sys

from kvwise.config import EngineConfig
from kvwise.types import SamplingParams

try:
    from kvwise.engine.builder import build_engine
except ImportError:  # before issue 9
    from kvwise.engine.llm_engine import LLMEngine as build_engine


def main(label: str) -> None:
    config = EngineConfig.from_kwargs(
        kv_cache_memory="1GiB",
        kv_host_memory="off",
        kv_disk_path="off",
        prefill_chunk_size=2112,
        max_num_batched_tokens=2112,
    )
    engine = build_engine(config, progress=False)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(2048)]
    one = SamplingParams(max_tokens=1, temperature=0)

    def run():
        engine.add_request(prefix + [rng.randrange(100, 49000) for _ in range(16)], one)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    last = out
        return last

    run()  # cold: computes the prefix
    ttfts = []
    for _ in range(9):
        out = run()
        assert out.num_cached_tokens == 2048
        ttfts.append(out.metrics.ttft)
    times = " ".join(f"{t * 1e3:.0f}" for t in ttfts)
    print(f"{label} {statistics.median(ttfts) * 1e3:.1f} ms  ({times})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kvwise")
