"""The served engine's one OpenMP team: `build_engine_for_loop` loads the model in a thread
that ends with the load, so no OpenMP worker of the load outlives it and the engine loop's
thread is the process's only team (with two teams on two cores libgomp's workers sleep at
every barrier: the served step was ~1.4x slower, docs/BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os
import time
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine, build_engine_for_loop

def threads():  # once the count holds for half a second (exiting workers take a moment)
    last, since, end = -1, time.monotonic(), time.monotonic() + 20
    while time.monotonic() < end:
        n = len(os.listdir("/proc/self/task"))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            break
        time.sleep(0.05)
    return last

config = EngineConfig.from_kwargs(kv_disk_path="off", kv_host_memory="off",
                                  kv_cache_memory="64MiB", num_threads=2)
engines = [build_engine_for_loop(config, progress=False)]  # lazily made pools, once
before = threads()
engines.append(build_engine_for_loop(config, progress=False))
after_loop = threads()
engines.append(build_engine(config, progress=False))  # the control: loaded here
after_main = threads()
print(before, after_loop, after_main)
"""


def test_the_load_thread_takes_its_openmp_workers_with_it():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    before, after_loop, after_main = (int(n) for n in out.stdout.split()[-3:])
    assert after_loop == before, "a load in its own thread left threads behind"
    # the control: the same load in this thread leaves its OpenMP worker (2 threads: 1 worker)
    assert after_main == before + 1, (before, after_main)
