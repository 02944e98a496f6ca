"""One layer's decode attention over a 4,096-token context in the paged pool (the default
model's shape: 9 query heads, 3 KV heads, head_dim 64, blocks of 16 in random order), float32
vs int8 KV, kvwise's paged kernel, median of 200 calls (docs/BENCHMARKS.md, issue 12)::

    .venv/bin/python scripts/paged_attention_bench.py [--context 4096]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvwise import kernels
from kvwise.core.kv_spec import KVSpec
from kvwise.worker.kv_cache import make_kv_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    args = p.parse_args()
    if not kernels.available():
        raise SystemExit("the kvwise kernels are unavailable here")
    ops = torch.ops.kvwise
    torch.set_num_threads(2)
    block_size, context = 16, args.context
    num_blocks = context // block_size + 4
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=gen)[: -(-context // block_size)].unsqueeze(0)
    lens, q = torch.tensor([context]), torch.randn(1, 9, 64, generator=gen)
    for dtype in ("float32", "int8"):
        cache = make_kv_cache(KVSpec(1, 3, 64, block_size, dtype), num_blocks)
        slots = torch.arange(num_blocks * block_size)
        kv = torch.randn(2, len(slots), 3, 64, generator=gen)
        cache.write(0, slots, kv[0], kv[1])
        k, v = cache.k_blocks[0], cache.v_blocks[0]
        if dtype == "int8":

            def call(k=k, v=v):
                return ops.paged_decode_attention_int8(q, k, v, table, lens, 0.125, block_size)
        else:

            def call(k=k, v=v):
                return ops.paged_decode_attention(q, k, v, table, lens, 0.125)

        for _ in range(20):
            call()
        times = []
        for _ in range(200):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        print(f"{dtype}: {sorted(times)[100] * 1e6:.0f} us a layer over {context} keys")


if __name__ == "__main__":
    main()
