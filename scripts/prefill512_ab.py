"""A/B of 512-token prefills in one process (issue 47): run with PYTHONPATH at each checkout,
alternating; prints tokens/s of the median of the last six of eight prefills."""

import random
import statistics
import sys
import time

import torch

from kvwise import LLM, SamplingParams

torch.set_num_threads(2)
llm = LLM(kv_host_memory="off", kv_disk_path="off", progress=False, enable_prefix_caching=False)

rng = random.Random(0)
ids = [rng.randrange(100, 40000) for _ in range(512)]
sp = SamplingParams(max_tokens=1, temperature=0.0)
times = []
for _ in range(8):
    t = time.perf_counter()
    llm.generate([ids], sp)
    times.append(time.perf_counter() - t)
print(
    sys.argv[1],
    "median tok/s",
    round(512 / statistics.median(times[2:]), 1),
    [round(512 / x) for x in times],
)
