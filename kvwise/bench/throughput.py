"""``kvwise bench throughput``: kvwise against transformers on the same weights and dtype.

Measured in one run, interleaved, each figure the median of ``--reps`` repetitions:

- single-request decode tokens/s (batch 1);
- 16 concurrent requests of mixed prompt and output lengths: total generated tokens/s
  (transformers: one padded batched ``generate`` over the same requests);
- prefill tokens/s at 512 and 2,048 prompt tokens;
- the decode step time against the memory-bandwidth bound: (weight bytes + KV bytes read per
  step) / measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench.common import (
    TimingStreamer,
    load_hf_reference,
    measure_read_bandwidth,
    median,
    run_to_completion,
)
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine, load_for
from kvwise.types import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=5, help="repetitions per figure (median)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens in the decode test")
    p.add_argument("--batch", type=int, default=16, help="concurrent requests")
    p.add_argument("--prefill-lens", default="512,2048", help="prompt lengths for prefill")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


class Bench:
    def __init__(self, args: argparse.Namespace, engine_kwargs: dict) -> None:
        self.args = args
        engine_kwargs = dict(engine_kwargs)
        engine_kwargs["prefill_chunk_size"] = max(
            [int(x) for x in args.prefill_lens.split(",")] + [engine_kwargs["prefill_chunk_size"]]
        )
        engine_kwargs["max_num_batched_tokens"] = max(
            engine_kwargs["max_num_batched_tokens"], engine_kwargs["prefill_chunk_size"]
        )
        engine_kwargs["enable_prefix_caching"] = False  # measure compute, not cache hits
        engine_kwargs.update(kv_host_memory="off", kv_disk_path="off", kv_redis_url=None)
        config = EngineConfig.from_kwargs(**engine_kwargs)
        loaded = load_for(config)
        self.engine = build_engine(config, loaded=loaded)
        self.hf = None if args.no_peer else load_hf_reference(loaded.source)
        self.vocab = loaded.arch.vocab_size
        rng = random.Random(0)
        self.decode_prompt = _random_prompt(rng, 32, self.vocab)
        self.batch_prompts = [
            _random_prompt(rng, rng.randint(16, 256), self.vocab) for _ in range(args.batch)
        ]
        self.batch_max_tokens = [rng.randint(16, 64) for _ in range(args.batch)]
        self.prefill_prompts = {
            int(n): _random_prompt(rng, int(n), self.vocab) for n in args.prefill_lens.split(",")
        }

    # ---- kvwise -------------------------------------------------------------------------

    def ours_decode(self) -> float:
        n = self.args.decode_tokens
        (out,), _ = run_to_completion(
            self.engine,
            [self.decode_prompt],
            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)],
        )
        times = out.metrics.token_times
        return (len(times) - 1) / (times[-1] - times[0])

    def ours_batch(self) -> float:
        params = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
            for m in self.batch_max_tokens
        ]
        outs, wall = run_to_completion(self.engine, self.batch_prompts, params)
        return sum(len(o.token_ids) for o in outs) / wall

    def ours_prefill(self, n: int) -> float:
        (out,), _ = run_to_completion(
            self.engine,
            [self.prefill_prompts[n]],
            [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)],
        )
        return n / out.metrics.ttft

    # ---- transformers -------------------------------------------------------------------

    @torch.inference_mode()
    def hf_decode(self) -> float:
        n = self.args.decode_tokens
        streamer = TimingStreamer()
        self.hf.generate(
            torch.tensor([self.decode_prompt]), max_new_tokens=n, do_sample=False, streamer=streamer
        )
        t = streamer.times
        return (len(t) - 1) / (t[-1] - t[0])

    @torch.inference_mode()
    def hf_batch(self) -> float:
        longest = max(len(p) for p in self.batch_prompts)
        ids = torch.zeros(len(self.batch_prompts), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(self.batch_prompts):  # left padding
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        start = time.perf_counter()
        self.hf.generate(
            ids, attention_mask=mask, max_new_tokens=max(self.batch_max_tokens), do_sample=False
        )
        wall = time.perf_counter() - start
        return sum(self.batch_max_tokens) / wall  # useful tokens only

    @torch.inference_mode()
    def hf_prefill(self, n: int) -> float:
        start = time.perf_counter()
        self.hf(torch.tensor([self.prefill_prompts[n]]), logits_to_keep=1)
        return n / (time.perf_counter() - start)

    # ---- the bound ----------------------------------------------------------------------

    def decode_bound(self, bandwidth: float) -> dict[str, float]:
        """Seconds per decode step if it only had to stream weights and KV once."""
        model = self.engine.runner.model
        # the embedding lookup reads one row; the LM head streams its whole matrix
        weight_bytes = model.weight_bytes()
        if model.embed is not None:
            weight_bytes -= model.embed.nbytes
        elif model.embed_quant is not model.lm_head_quant:  # untied, quantized
            weight_bytes -= model.embed_quant.nbytes
        ctx = len(self.decode_prompt) + self.args.decode_tokens // 2  # mean context length
        kv_bytes = ctx * self.engine.runner.spec.bytes_per_token
        return {
            "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes,
            "bound_s": (weight_bytes + kv_bytes) / bandwidth,
        }

    def run(self) -> dict:
        args = self.args
        figures = ["decode", "batch"] + [f"prefill_{n}" for n in self.prefill_prompts]
        ours: dict[str, list[float]] = {f: [] for f in figures}
        peer: dict[str, list[float]] = {f: [] for f in figures}
        # warm up both
        self.ours_prefill(min(self.prefill_prompts))
        if self.hf is not None:
            self.hf_prefill(min(self.prefill_prompts))
        for _ in tqdm(range(args.reps), desc="bench throughput", unit="rep"):
            for name in figures:
                if name.startswith("prefill_"):
                    n = int(name.split("_")[1])
                    ours[name].append(self.ours_prefill(n))
                    if self.hf is not None:
                        peer[name].append(self.hf_prefill(n))
                else:
                    ours[name].append(getattr(self, f"ours_{name}")())
                    if self.hf is not None:
                        peer[name].append(getattr(self, f"hf_{name}")())
        bandwidth = measure_read_bandwidth()
        bound = self.decode_bound(bandwidth)
        result = {
            "threads": torch.get_num_threads(),
            "reps": args.reps,
            "bandwidth_GBps": bandwidth / 1e9,
            "ours": {k: median(v) for k, v in ours.items()},
            "peer": {k: median(v) for k, v in peer.items()},
            "ours_all": ours,
            "peer_all": peer,
            **bound,
        }
        result["decode_step_s"] = 1 / result["ours"]["decode"]
        result["decode_vs_bound"] = result["decode_step_s"] / bound["bound_s"]
        return result


def format_table(r: dict, args: argparse.Namespace) -> str:
    labels = {
        "decode": "single-request decode (tokens/s)",
        "batch": f"{args.batch} concurrent, mixed lengths (total tokens/s)",
    }
    lines = ["| figure | kvwise | transformers | ratio |", "|---|---:|---:|---:|"]
    for key, ours in r["ours"].items():
        label = labels[key] if key in labels else f"prefill {key[8:]} tokens (tokens/s)"
        peer = r["peer"].get(key, float("nan"))
        lines.append(f"| {label} | {ours:.1f} | {peer:.1f} | {ours / peer:.2f}x |")
    lines.append(
        f"\nDecode step {r['decode_step_s'] * 1000:.1f} ms vs bandwidth bound "
        f"{r['bound_s'] * 1000:.1f} ms ({r['weight_bytes'] / 1e6:.0f} MB weights + "
        f"{r['kv_bytes'] / 1e6:.1f} MB KV at {r['bandwidth_GBps']:.1f} GB/s): "
        f"{r['decode_vs_bound']:.2f}x the bound. Medians of {r['reps']} interleaved reps, "
        f"{r['threads']} threads."
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from kvwise.engine_args import engine_kwargs

    result = Bench(args, engine_kwargs(args)).run()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(format_table(result, args))
    return 0
