"""The four matmuls of one default-model layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) and the LM head (49,152x576) at several row counts: torch's CPU int4 kernel
(bfloat16 activations, what kvwise ran before), kvwise's int4 x int8 kernel (q4mm: its AVX2
code, and its AVX-512 VNNI code where this CPU runs it) and float32 GEMM; for the LM head,
torch's int8 kernel against kvwise's q8mm. Interleaved, medians of 9 (docs/BENCHMARKS.md,
issue 11)::

    .venv/bin/python scripts/q4mm_bench.py
"""

from __future__ import annotations

import time

import torch

from kvwise import kernels
from kvwise.models.quant import Int4Weight, Int8Weight, Q8Weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def median_seconds(fn, n: int = 9) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def torch_int4(weight: torch.Tensor):
    """torch's int4 kernel on the same codes (its scale/zero in bfloat16): a closure x -> out."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features, in_features // 32, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((blocks - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.reshape(out_features, in_features).to(torch.int32), 2
    )
    sz = torch.stack((scale.t(), (low + 8 * scale).t()), -1).to(torch.bfloat16).contiguous()
    return lambda x: _INT4_MM(x.to(torch.bfloat16), packed, 32, sz)


def main() -> None:
    if not kernels.available():
        raise SystemExit("the kvwise kernels are unavailable here")
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    floats = [torch.randn(o, i, generator=gen) for o, i in SHAPES]
    theirs = [torch_int4(w) for w in floats]
    ours = [Int4Weight.quantize(w) for w in floats]
    dense = [w.t().contiguous() for w in floats]
    isas = kernels.block_isas()

    def ours_on(isa: str, fn):
        def run():
            kernels.block_isa(isa)
            return fn()

        return run

    print("| rows | torch int4 (bf16 activations) | "
          + " | ".join(f"kvwise q4mm, {isa}" for isa in isas)
          + " | float32 GEMM |\n|---:|---:|" + "---:|" * len(isas) + "---:|")  # fmt: skip
    for rows in (1, 4, 16, 64, 512):
        xs = [torch.randn(rows, i, generator=gen) for _, i in SHAPES]
        times = [
            median_seconds(lambda xs=xs: [f(x) for f, x in zip(theirs, xs)]),
            *(
                median_seconds(ours_on(isa, lambda xs=xs: [w.mm(x) for w, x in zip(ours, xs)]))
                for isa in isas
            ),
            median_seconds(lambda xs=xs: [x @ w for w, x in zip(dense, xs)]),
        ]
        flops = 2 * rows * sum(o * i for o, i in SHAPES)
        print(f"| {rows} | " + " | ".join(
            f"{s * 1e3:.3f} ms ({flops / s / 1e9:.0f} GFLOP/s)" for s in times) + " |")  # fmt: skip
    head = torch.randn(*HEAD, generator=gen) * 0.05
    int8, q8 = Int8Weight.quantize(head), Q8Weight.quantize(head)
    print("\n| LM head rows | torch int8 (per row, bf16 activations) | "
          + " | ".join(f"kvwise q8mm, {isa}" for isa in isas)
          + " |\n|---:|---:|" + "---:|" * len(isas))  # fmt: skip
    for rows in (1, 16):
        x = torch.randn(rows, HEAD[1], generator=gen)
        times = [
            median_seconds(lambda x=x: int8.mm(x)),
            *(median_seconds(ours_on(isa, lambda x=x: q8.mm(x))) for isa in isas),
        ]
        print(f"| {rows} | " + " | ".join(f"{s * 1e3:.3f} ms" for s in times) + " |")


if __name__ == "__main__":
    main()
