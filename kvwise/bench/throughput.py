"""``kvwise bench throughput``: kvwise against its peers on the same weights, in one run.

Columns: kvwise in the format asked for (``--quantization``, default auto), kvwise's float32
reference path (``--compare-quantization none``; ``''`` drops it), llama.cpp on the same GGUF
(``llama-bench`` and ``llama-server`` from ``--llama-cpp DIR``, ``$KVWISE_LLAMA_CPP`` or
``PATH``; ``--no-llama-cpp`` drops it) and transformers (``--no-peer`` drops it). Each figure
is the median of ``--reps`` repetitions; every repetition measures every column in turn:

- single-request decode tokens/s after a 32-token prompt (llama.cpp: ``llama-bench -p 0
  -n 128 -d 32``, its ``tg128 @ d32``);
- 16 concurrent requests of mixed prompt and output lengths: total generated tokens/s over
  the whole run, prefills included (llama.cpp: ``llama-server`` with 16 slots, the same token
  ids sent at once; transformers: one padded batched ``generate``), and for kvwise also the
  decode phase alone (tokens after the last first token / the time from it to the end);
- prefill tokens/s at 512 and 2,048 prompt tokens (llama.cpp: ``llama-bench -p N -n 0``);
- the decode step time against the memory-bandwidth bound: (weight bytes + KV bytes read per
  step) / measured read bandwidth (a mixture of experts' weights: the experts a token runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvwise.bench import llamacpp
from kvwise.bench.common import (
    TimingStreamer,
    load_hf_reference,
    measure_read_bandwidth,
    median,
    run_to_completion,
)
from kvwise.bench.progress import phase
from kvwise.config import EngineConfig
from kvwise.engine.builder import build_engine, load_for
from kvwise.types import SamplingParams

FIGURES = ("decode", "batch", "batch_decode")


def _column(weight_format: str) -> str:
    return f"kvwise {'float32' if weight_format == 'none' else weight_format}"


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
        self.engines = {_column(loaded.weight_format): self.engine}
        if args.compare_quantization and args.compare_quantization != config.model.quantization:
            other = EngineConfig.from_kwargs(
                **{**engine_kwargs, "quantization": args.compare_quantization}
            )
            other_loaded = load_for(other)
            self.engines[_column(other_loaded.weight_format)] = build_engine(
                other, loaded=other_loaded
            )
        self.hf = None
        if not args.no_peer:
            with phase("loading transformers' reference"):
                self.hf = load_hf_reference(loaded.source)
        self.model_path = str(loaded.source)
        self.llama = None
        if not args.no_llama_cpp and self.model_path.endswith(".gguf"):
            found = {
                n: llamacpp.find_binary(n, args.llama_cpp) for n in ("llama-bench", "llama-server")
            }
            if all(found.values()):
                self.llama = found
            else:
                print("llama.cpp column skipped: llama-bench / llama-server not found")
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

    def ours_decode(self, engine) -> float:
        n = self.args.decode_tokens
        (out,), _ = run_to_completion(
            engine,
            [self.decode_prompt],
            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)],
        )
        times = out.metrics.token_times
        return (len(times) - 1) / (times[-1] - times[0])

    def ours_batch(self, engine) -> tuple[float, float]:
        """(total generated tokens/s, tokens/s of the decode phase after every first token)"""
        params = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
            for m in self.batch_max_tokens
        ]
        outs, wall = run_to_completion(engine, self.batch_prompts, params)
        firsts = [o.metrics.token_times[0] for o in outs]
        last = max(o.metrics.token_times[-1] for o in outs)
        after = sum(sum(t > max(firsts) for t in o.metrics.token_times) for o in outs)
        span = last - max(firsts)
        return sum(len(o.token_ids) for o in outs) / wall, after / span if span > 0 else float(
            "nan"
        )

    def ours_prefill(self, engine, n: int) -> float:
        (out,), _ = run_to_completion(
            engine,
            [self.prefill_prompts[n]],
            [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)],
        )
        return n / out.metrics.ttft

    # ---- llama.cpp ----------------------------------------------------------------------

    def llama_decode(self) -> float:
        n = str(self.args.decode_tokens)
        depth = str(len(self.decode_prompt))
        rows = llamacpp.llama_bench(
            self.llama["llama-bench"],
            self.model_path,
            torch.get_num_threads(),
            "-p",
            "0",
            "-n",
            n,
            "-d",
            depth,
        )
        return rows[0]["avg_ts"]

    def llama_prefill(self, n: int) -> float:
        rows = llamacpp.llama_bench(
            self.llama["llama-bench"],
            self.model_path,
            torch.get_num_threads(),
            "-p",
            str(n),
            "-n",
            "0",
        )
        return rows[0]["avg_ts"]

    def llama_batch(self, server: llamacpp.LlamaServer) -> float:
        import httpx

        async def go() -> float:
            async with httpx.AsyncClient(timeout=600) as http:
                bodies = [
                    {
                        "prompt": p,
                        "n_predict": m,
                        "temperature": 0,
                        "ignore_eos": True,
                        "cache_prompt": False,
                    }
                    for p, m in zip(self.batch_prompts, self.batch_max_tokens)
                ]
                start = time.perf_counter()
                replies = await asyncio.gather(
                    *(http.post(f"{server.url}/completion", json=b) for b in bodies)
                )
                wall = time.perf_counter() - start
            return sum(r.json()["tokens_predicted"] for r in replies) / wall

        return asyncio.run(go())

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
        for layer in model.layers:  # a mixture of experts: a token reads its top k experts
            moe = getattr(layer, "moe", None)
            if moe is not None:
                weight_bytes -= round(moe.routed_nbytes() * (1 - moe.top_k / moe.num_experts))
        ctx = len(self.decode_prompt) + self.args.decode_tokens // 2  # mean context length
        kv_bytes = ctx * self.engine.runner.spec.bytes_per_token
        return {
            "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes,
            "bound_s": (weight_bytes + kv_bytes) / bandwidth,
        }

    def run(self) -> dict:
        args = self.args
        figures = [*FIGURES] + [f"prefill_{n}" for n in self.prefill_prompts]
        columns = [*self.engines] + (["llama.cpp"] if self.llama else [])
        columns += ["transformers"] if self.hf is not None else []
        values: dict[str, dict[str, list[float]]] = {c: {f: [] for f in figures} for c in columns}
        server = None
        if self.llama:
            longest = max(len(p) for p in self.batch_prompts) + max(self.batch_max_tokens)
            server = llamacpp.LlamaServer(
                self.llama["llama-server"],
                self.model_path,
                torch.get_num_threads(),
                args.batch,
                longest + 64,
            )
            server.__enter__()
        try:
            with phase("warm-up"):
                for engine in self.engines.values():
                    self.ours_prefill(engine, min(self.prefill_prompts))
                if self.hf is not None:
                    self.hf_prefill(min(self.prefill_prompts))
            for _ in tqdm(range(args.reps), desc="bench throughput", unit="rep"):
                for name, engine in self.engines.items():
                    got = values[name]
                    got["decode"].append(self.ours_decode(engine))
                    total, decode_phase = self.ours_batch(engine)
                    got["batch"].append(total)
                    got["batch_decode"].append(decode_phase)
                    for n in self.prefill_prompts:
                        got[f"prefill_{n}"].append(self.ours_prefill(engine, n))
                if self.llama:
                    got = values["llama.cpp"]
                    got["decode"].append(self.llama_decode())
                    got["batch"].append(self.llama_batch(server))
                    for n in self.prefill_prompts:
                        got[f"prefill_{n}"].append(self.llama_prefill(n))
                if self.hf is not None:
                    got = values["transformers"]
                    got["decode"].append(self.hf_decode())
                    got["batch"].append(self.hf_batch())
                    for n in self.prefill_prompts:
                        got[f"prefill_{n}"].append(self.hf_prefill(n))
        finally:
            if server is not None:
                server.__exit__()
        with phase("measuring the memory read bandwidth"):
            bandwidth = measure_read_bandwidth()
        bound = self.decode_bound(bandwidth)
        medians = {c: {f: median(v) for f, v in by.items()} for c, by in values.items()}
        main = columns[0]
        result = {
            "threads": torch.get_num_threads(),
            "reps": args.reps,
            "bandwidth_GBps": bandwidth / 1e9,
            "columns": columns,
            "medians": medians,
            "all": values,
            **bound,
        }
        result["decode_step_s"] = 1 / medians[main]["decode"]
        result["decode_vs_bound"] = result["decode_step_s"] / bound["bound_s"]
        return result


def format_table(r: dict, args: argparse.Namespace) -> str:
    labels = {
        "decode": "single-request decode (tokens/s)",
        "batch": f"{args.batch} concurrent, mixed lengths (total tokens/s)",
        "batch_decode": f"{args.batch} concurrent, decode phase (tokens/s)",
    }
    columns, medians = r["columns"], r["medians"]
    main, others = columns[0], columns[1:]
    lines = [
        "| figure | "
        + " | ".join(columns)
        + " | "
        + " | ".join(f"{main} / {o}" for o in others)
        + " |",
        "|---|" + "---:|" * (len(columns) + len(others)),
    ]
    for key in medians[main]:
        label = labels.get(key) or f"prefill {key[8:]} tokens (tokens/s)"
        cells = [f"{medians[c][key]:.1f}" for c in columns]
        ratios = [f"{medians[main][key] / medians[o][key]:.2f}x" for o in others]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")
    lines.append(
        f"\nDecode step ({main}) {r['decode_step_s'] * 1000:.1f} ms vs bandwidth bound "
        f"{r['bound_s'] * 1000:.1f} ms ({r['weight_bytes'] / 1e6:.0f} MB weights + "
        f"{r['kv_bytes'] / 1e6:.1f} MB KV at {r['bandwidth_GBps']:.1f} GB/s): "
        f"{r['decode_vs_bound']:.2f}x the bound. Medians of {r['reps']} interleaved reps, "
        f"{r['threads']} threads; nan: not measured for that column."
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    from kvwise.cli.engine_args import engine_kwargs

    result = Bench(args, engine_kwargs(args)).run()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(format_table(result, args))
    return 0
