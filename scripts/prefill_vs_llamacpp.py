"""Prefill, kvwise vs llama.cpp on the same GGUF, interleaved: prompt tokens/s of one
``--tokens``-token prompt (kvwise: a random prompt, prefix caching off, one new token; the
time to it), against ``llama-bench -t 2 -fa 1 -p N -n 0 -r 1`` (its ``ppN``), ``--reps``
rounds, medians::

    .venv/bin/python scripts/prefill_vs_llamacpp.py --llama-bench PATH/llama-bench \
        --model FILE.gguf --tokens 512 --reps 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time

from kvwise import LLM, SamplingParams


def kvwise_rate(llm: LLM, rng: random.Random, n: int) -> float:
    prompt = [rng.randrange(100, 30000) for _ in range(n)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return n / (time.perf_counter() - start)


def llama_rate(binary: str, model: str, n: int) -> float:
    out = subprocess.run([binary, "-m", model, "-t", "2", "-fa", "1", "-p", str(n), "-n", "0",
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)  # fmt: skip
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    engine = LLM(
        args.model, progress=False, quantization="auto", kv_cache_memory="512MiB",
        kv_host_memory="off", kv_disk_path="off", enable_prefix_caching=False,
        prefill_chunk_size=args.tokens, max_num_batched_tokens=max(2048, args.tokens),
    )  # fmt: skip
    rng = random.Random(0)
    kvwise_rate(engine, rng, args.tokens)  # warm-up
    ours, theirs = [], []
    for _ in range(args.reps):
        ours.append(kvwise_rate(engine, rng, args.tokens))
        theirs.append(llama_rate(args.llama_bench, args.model, args.tokens))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"prefill {args.tokens} tokens/s (median of {args.reps}): kvwise {a:.1f}, "
          f"llama.cpp {b:.1f}: {a / b:.2f}x  (kvwise {[round(x) for x in ours]}, "
          f"llama.cpp {[round(x) for x in theirs]})")  # fmt: skip


if __name__ == "__main__":
    main()
