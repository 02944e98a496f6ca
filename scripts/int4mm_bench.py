"""The four matmuls of one default-model layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) at several row counts: torch's int4 kernel, kvwise's int4mm (bit for bit the same
results, checked here) and float32 GEMM, interleaved, medians of 9 (docs/BENCHMARKS.md,
issue 11)::

    .venv/bin/python scripts/int4mm_bench.py
"""

from __future__ import annotations

import time

import torch

from kvwise.models.quant import Int4Weight
from kvwise.worker import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)


def median_seconds(fn, n: int = 9) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def main() -> None:
    if not kernels.available():
        raise SystemExit("the kvwise kernels are unavailable here")
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    weights = [Int4Weight.quantize(torch.randn(o, i, generator=gen)) for o, i in SHAPES]
    floats = [w.dequantize().t().contiguous() for w in weights]
    ops = torch.ops.kvwise
    print("| rows | torch int4 | kvwise int4mm | float32 GEMM |\n|---:|---:|---:|---:|")
    for rows in (1, 2, 4, 16, 64, 256, 512):
        xs = [torch.randn(rows, i, generator=gen).to(torch.bfloat16) for _, i in SHAPES]
        xf = [x.float() for x in xs]
        for w, x in zip(weights, xs):
            assert torch.equal(w.mm(x), ops.int4mm(x, w.packed, w.group_size, w.scales_zeros))
        torch_s = median_seconds(lambda xs=xs: [w.mm(x) for w, x in zip(weights, xs)])
        ours_s = median_seconds(
            lambda xs=xs: [
                ops.int4mm(x, w.packed, w.group_size, w.scales_zeros) for w, x in zip(weights, xs)
            ]  # fmt: skip
        )
        f32_s = median_seconds(lambda xf=xf: [x @ f for f, x in zip(floats, xf)])
        flops = 2 * rows * sum(o * i for o, i in SHAPES)
        print(f"| {rows} | " + " | ".join(
            f"{flops / s / 1e9:.0f} GFLOP/s" for s in (torch_s, ours_s, f32_s)) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
