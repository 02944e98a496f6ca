"""Loading a GGUF, kvwise vs llama.cpp, side by side: time from ``LLM(...)`` to the first
generated token, and the process's peak resident memory (VmHWM).

  .venv/bin/python scripts/load_vs_llamacpp.py --llama-simple PATH/llama-simple \
      --reps 5 FILE.gguf [FILE.gguf ...]

Each rep runs a fresh process per engine, interleaved, with the file in the page cache (one
read first, as a second start of either engine finds it). kvwise's child imports everything
first (Python's own start-up and imports aside, as issue 27 asks) and then times ``LLM(model,
quantization="auto", kv_cache_memory=KV, tiers off)`` plus one greedy token; it reports its
RSS after the imports too, so the table shows what loading added. llama.cpp runs
``llama-simple -m FILE -n 1`` under ``/usr/bin/time -v``: its wall time (process start
included; a C++ process starts in milliseconds) and maximum resident set size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import kvwise, torch
from kvwise import kernels
kernels.available()
from kvwise import LLM, SamplingParams
def rss():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield line.split()[0][:-1], int(line.split()[1]) * 1024
base = dict(rss())["VmRSS"]
t0 = time.perf_counter()
llm = LLM(sys.argv[1], progress=False, quantization="auto", kv_cache_memory=sys.argv[2],
          kv_host_memory="off", kv_disk_path="off")
t1 = time.perf_counter()
out = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0))
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t0, "base_rss": base,
                  "peak_rss": dict(rss())["VmHWM"]}))
"""


def kvwise_run(path: Path, kv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), kv], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_run(binary: str, path: Path) -> dict:
    start = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-v", binary, "-m", str(path), "-n", "1", "Hello"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    wall = time.perf_counter() - start
    rss = next(int(line.split(":")[1]) * 1024 for line in out.stderr.splitlines()
               if "Maximum resident set size" in line)  # fmt: skip
    return {"first_token_s": wall, "peak_rss": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--llama-simple", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kv", default="64MiB", help="kvwise's KV pool (kv_cache_memory)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = {}
    for path in args.files:
        path.read_bytes()  # into the page cache, for both
        runs = {"kvwise": [], "llama.cpp": []}
        for _ in range(args.reps):
            runs["kvwise"].append(kvwise_run(path, args.kv))
            runs["llama.cpp"].append(llama_run(args.llama_simple, path))
        med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for e, rs in runs.items()}  # fmt: skip
        size = path.stat().st_size
        results[path.name] = {"file_bytes": size, "median": med, "runs": runs}
        k, ll = med["kvwise"], med["llama.cpp"]
        print(f"{path.name} ({size / 2**20:.0f} MiB): first token kvwise {k['first_token_s']:.2f} s "
              f"(load {k['load_s']:.2f} s) vs llama.cpp {ll['first_token_s']:.2f} s = "
              f"{k['first_token_s'] / ll['first_token_s']:.2f}x; peak RSS kvwise "
              f"{k['peak_rss'] / 2**20:.0f} MiB ({k['peak_rss'] / size:.2f}x file; after "
              f"imports {k['base_rss'] / 2**20:.0f} MiB, loading added "
              f"{(k['peak_rss'] - k['base_rss']) / size:.2f}x file) vs llama.cpp "
              f"{ll['peak_rss'] / 2**20:.0f} MiB ({ll['peak_rss'] / size:.2f}x)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
