"""Single-request decode, kvwise vs llama.cpp on the same GGUF, interleaved: 128 new tokens
after each context (``--contexts``, default a 32-token and a 2,048-token one), ``--reps``
rounds, medians.

kvwise runs each weight format (``--formats auto,none``) with each KV format (``--kv-dtypes``,
default the compute dtype) in this process, one engine each, prefix caching off; llama.cpp
runs ``llama-bench -t 2 -fa 1 -p 0 -n 128 -d 0,2048 -r 1`` once per round (its ``tg128 @ dN``:
128 tokens generated after N tokens of context; its KV f16, its default). A rate is generated
tokens / the time between the first and the last of them::

    .venv/bin/python scripts/decode_vs_llamacpp.py --llama-bench PATH/llama-bench --reps 5
    .venv/bin/python scripts/decode_vs_llamacpp.py --llama-bench PATH/llama-bench \
        --formats auto --kv-dtypes float32,int8 --contexts 32,2048,4096
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess

from tqdm import tqdm

from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine, load_for
from kvwise.types import SamplingParams

CONTEXTS = [32, 2048]
NEW_TOKENS = 128


def kvwise_rate(engine, rng: random.Random, context: int) -> float:
    prompt = [rng.randrange(100, 49000) for _ in range(context)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                times = out.metrics.token_times
    return (len(times) - 1) / (times[-1] - times[0])


def llama_rates(binary: str, model: str) -> dict[int, float]:
    depths = ",".join(str(0 if c <= 32 else c) for c in CONTEXTS)
    cmd = [binary, "-m", model, "-t", "2", "-fa", "1", "-p", "0", "-n", str(NEW_TOKENS),
           "-d", depths, "-r", "1", "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    by_depth = {row["n_depth"]: row["avg_ts"] for row in rows}
    return {c: by_depth[0 if c <= 32 else c] for c in CONTEXTS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", default=None,
                   help="path of llama.cpp's llama-bench (without it: kvwise alone, ratios "
                   "against its first setting)")  # fmt: skip
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--formats", default="auto,none", help="kvwise quantization settings")
    p.add_argument("--kv-dtypes", default="auto", help="kvwise kv_cache_dtype settings")
    p.add_argument("--contexts", default="32,2048", help="context lengths before decoding")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    CONTEXTS[:] = [int(c) for c in args.contexts.split(",")]
    engines = {}
    kv_dtypes = args.kv_dtypes.split(",")
    for fmt in args.formats.split(","):
        loaded = None
        for kv_dtype in kv_dtypes:
            config = EngineConfig.from_kwargs(
                model=args.model, quantization=fmt, kv_cache_dtype=kv_dtype, kv_cache_memory="1GiB",
                kv_host_memory="off", kv_disk_path="off", enable_prefix_caching=False,
                prefill_chunk_size=2048, max_num_batched_tokens=2048,
            )  # fmt: skip
            loaded = loaded or load_for(config, progress=False)
            name = fmt if len(kv_dtypes) == 1 else f"{fmt}, KV {kv_dtype}"
            engines[name] = (
                build_engine(config, progress=False, loaded=loaded),
                str(loaded.source),
            )
    model = next(iter(engines.values()))[1]
    rng = random.Random(0)
    for engine, _ in engines.values():  # warm-up
        kvwise_rate(engine, rng, 32)
    peer = "llama.cpp" if args.llama_bench else next(iter(engines))
    names = [*engines, "llama.cpp"] if args.llama_bench else [*engines]
    rates: dict[str, dict[int, list[float]]] = {name: {c: [] for c in CONTEXTS} for name in names}
    for _ in tqdm(range(args.reps), desc="rounds"):
        for name, (engine, _) in engines.items():
            for context in CONTEXTS:
                rates[name][context].append(kvwise_rate(engine, rng, context))
        if args.llama_bench:
            for context, rate in llama_rates(args.llama_bench, model).items():
                rates["llama.cpp"][context].append(rate)
    medians = {n: {c: statistics.median(r) for c, r in by.items()} for n, by in rates.items()}
    print(f"| decode tokens/s (median of {args.reps}) | " + " | ".join(
        f"after {c} tokens" for c in CONTEXTS) + " |")  # fmt: skip
    print("|---|" + "---:|" * len(CONTEXTS))
    for name, by in medians.items():
        cells = []
        for c in CONTEXTS:
            ratio = by[c] / medians[peer][c]
            cells.append(f"{by[c]:.1f} ({ratio:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rates": rates, "medians": medians}, f, indent=2)


if __name__ == "__main__":
    main()
