"""The hybrid KV cache's memory on a model with sliding-window layers (Gemma 3 by default):
KV bytes of one long sequence, hybrid against every layer keeping every token, and how many
long sequences run at once in the same fixed pool (``--no-hybrid-kv-cache`` the other side).

    python scripts/hybrid_memory.py --seqs 8 --tokens 8192 --pool-seqs 2 --out /tmp/hm.json

The pool holds ``--pool-seqs`` all-full sequences of ``--tokens``; each side gets the same
bytes and the same ``--seqs`` random prompts of ``--tokens - max_tokens`` tokens, all
admitted at once (each step a ``--chunk`` of every prompt), and reports the most sequences
decoding at once (their whole prompt in the pool), the preemptions and the wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tqdm import tqdm

from kvwise import SamplingParams
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine
from kvwise.models.default import gemma3_model_path
from kvwise.models.loader import load_model


def _side(loaded, model, hybrid: bool, pool_bytes: int, prompts, max_tokens: int, chunk: int):
    config = EngineConfig.from_kwargs(
        model=model, hybrid_kv_cache=hybrid, kv_cache_memory=f"{pool_bytes}B",
        prefill_chunk_size=chunk, max_num_batched_tokens=chunk * len(prompts),
        max_num_seqs=len(prompts),
        kv_disk_path="off", kv_host_memory=0,
    )  # fmt: skip
    engine = build_engine(config, progress=False, loaded=loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    most, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(prompts), desc=f"hybrid={hybrid}", unit="seq")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                bar.update()
        decoding = sum(1 for r in engine.scheduler.running if r.num_output_tokens > 0)
        most = max(most, decoding)
    bar.close()
    spec = engine.runner.spec
    return {
        "hybrid": hybrid,
        "most_decoding_at_once": most,
        "preemptions": engine.scheduler.num_preemptions,
        "wall_s": round(time.perf_counter() - t0, 1),
        "pool_blocks": engine.kv_manager.num_blocks,
        "page_bytes": spec.block_bytes,
        "layout": spec.layout,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the Gemma 3 270M GGUF")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--pool-seqs", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (and step) tokens")
    ap.add_argument("--long", type=int, default=32768, help="the one sequence's bytes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model or str(gemma3_model_path())
    loaded = load_model(model, progress=False)
    arch = loaded.arch
    per_token_all_full = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4  # float32
    pool = int(args.pool_seqs * args.tokens * per_token_all_full) + (1 << 20)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, arch.vocab_size - 10) for _ in range(args.tokens - args.max_tokens)]
               for _ in range(args.seqs)]  # fmt: skip
    result = {"model": model, "tokens": args.tokens, "seqs": args.seqs, "pool_bytes": pool}
    sides = [_side(loaded, model, h, pool, prompts, args.max_tokens, args.chunk)
             for h in (False, True)]  # fmt: skip
    result["sides"] = sides
    config = EngineConfig.from_kwargs(model=model, kv_cache_memory="64MiB", kv_disk_path="off")
    spec = build_engine(config, progress=False, loaded=loaded).runner.spec
    full_bytes = -(-args.long // spec.block_size) * spec.block_size * per_token_all_full
    result["long_sequence"] = {
        "tokens": args.long, "hybrid_bytes": spec.seq_bytes(args.long),
        "all_full_bytes": full_bytes, "ratio": spec.seq_bytes(args.long) / full_bytes,
    }  # fmt: skip
    result["ratio_at_once"] = sides[1]["most_decoding_at_once"] / max(
        1, sides[0]["most_decoding_at_once"]
    )
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
