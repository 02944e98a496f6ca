"""A/B of a float32 (or other) prefill of 2,048 tokens in one chunk, 4 reps in this process:
run it with PYTHONPATH pointing at each checkout, alternating (docs/BENCHMARKS.md, issue 26).

    PYTHONPATH=. .venv/bin/python scripts/ab_prefill.py none after
"""

import statistics
import sys
import time

import torch

from kvwise import LLM, SamplingParams

torch.set_num_threads(2)

quant = sys.argv[1]
llm = LLM(
    quantization=quant,
    kv_host_memory="off",
    kv_disk_path="off",
    progress=False,
    enable_prefix_caching=False,
    prefill_chunk_size=2048,
    max_num_batched_tokens=2048,
)
ids = [(i * 7919) % 40000 + 100 for i in range(2048)]
sp = SamplingParams(max_tokens=1, temperature=0.0)
times = []
for _rep in range(4):
    t = time.perf_counter()
    llm.generate([ids], sp)
    times.append(time.perf_counter() - t)
print(
    sys.argv[2],
    quant,
    "prefill 2048 s:",
    " ".join(f"{x:.2f}" for x in times),
    "median",
    f"{statistics.median(times[1:]):.2f}",
)
