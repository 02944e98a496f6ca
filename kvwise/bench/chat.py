"""``kvwise bench chat``: multi-turn chat, llama.cpp's home ground, kvwise vs ``llama-server``
(and vLLM's CPU build with ``--vllm-python``).

``--conversations`` chats run at once against each server, ``--turns`` turns each. Every
turn sends the whole history plus a new user message of about ``--turn-tokens`` tokens (real
text: consecutive slices of the Python language reference shipped with the interpreter,
``pydoc_data.topics``; each conversation reads its own slices) and streams ``--max-tokens``
greedy tokens back, which join the history. Both servers keep what they computed: kvwise
through its prefix cache (and its tiers), llama-server through its per-slot prompt cache, one
slot per conversation (``-np``), so each turn costs the prefill of its new tokens against a
cached context that grows to several thousand tokens; vLLM (``vllm_peer``: the model as an HF
directory, bf16, prefix caching on, 2 GiB of KV like kvwise's pool) through its prefix cache.
Reported: TTFT per turn (median over the
conversations) and the prompt size each turn reached. The servers run one after the other,
``--rounds`` times alternately; medians pool all rounds. Progress on stderr: each server's
start-up and a bar over each run's turns (``bench/progress.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvwise.bench import llamacpp, vllm_peer
from kvwise.bench.common import kvwise_serve_cmd, serve_process, sse_chunks
from kvwise.bench.progress import bar

# characters per token of the reference text under the default model's tokenizer (measured:
# 4.0-4.3 on slices of pydoc_data.topics); used only to cut slices of about the right size
_CHARS_PER_TOKEN = 4.1


def _slices(count: int, size_chars: int) -> list[str]:
    """``count`` consecutive slices of the reference text, cut at whitespace."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    out, pos = [], 0
    for _ in range(count):
        end = text.find(" ", pos + size_chars)
        end = len(text) if end < 0 else end
        out.append(text[pos:end].strip())
        pos = end
    return out


async def _conversation(
    http, url: str, model: str, user_turns: list[str], max_tokens: int, done=lambda: None
):
    """Run one conversation; per turn (TTFT s, prompt tokens or None). ``done()`` after each
    turn."""
    messages, results = [], []
    for text in user_turns:
        messages.append({"role": "user", "content": text})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first, reply, prompt_tokens = time.perf_counter(), None, [], None
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status_code}: {await resp.aread()!r}")
            async for chunk in sse_chunks(resp):
                if chunk.get("usage"):
                    prompt_tokens = chunk["usage"].get("prompt_tokens")
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        first = first or time.perf_counter()
                        reply.append(content)
        results.append((first - start if first else float("nan"), prompt_tokens))
        messages.append({"role": "assistant", "content": "".join(reply)})
        done()
    return results


async def _chat_load(url: str, args: argparse.Namespace, label: str = "chat") -> dict:
    import httpx

    size = int(args.turn_tokens * _CHARS_PER_TOKEN)
    texts = _slices(args.conversations * args.turns, size)
    # a fresh connection per request: llama-server closes idle keep-alive connections after a
    # few seconds, and a request sent on one that is closing fails before it is read
    limits = httpx.Limits(max_keepalive_connections=0)
    turns = [texts[c * args.turns : (c + 1) * args.turns] for c in range(args.conversations)]
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        with bar(args.conversations * args.turns, label, "turn") as progress:
            runs = await asyncio.gather(
                *(
                    _conversation(http, url, model, user_turns, args.max_tokens, progress.update)
                    for user_turns in turns
                )
            )
    return {
        "ttft_s": [[run[t][0] for run in runs] for t in range(args.turns)],
        "prompt_tokens": [[run[t][1] for run in runs] for t in range(args.turns)],
    }


def main(args: argparse.Namespace) -> int:
    import logging

    from kvwise.models.default import default_model_path

    logging.getLogger("httpx").setLevel(logging.WARNING)
    gguf = str(Path(args.model) if args.model else default_model_path())
    binary = None if args.no_llama_cpp else llamacpp.find_binary("llama-server", args.llama_cpp)
    if not binary and not args.no_llama_cpp:
        print("llama.cpp skipped: llama-server not found (--llama-cpp DIR)")
    slot_ctx = (args.turn_tokens + args.max_tokens + 64) * args.turns + 512
    runs: dict[str, list[dict]] = {"kvwise": []}
    if binary:
        runs["llama.cpp"] = []
    vllm = vllm_peer.find_python(args.vllm_python)
    if vllm:
        runs["vllm"] = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as disk:  # a fresh disk tier: nothing stored before
            port = llamacpp.free_port()
            cmd = kvwise_serve_cmd(gguf, port, "--kv-cache-memory", "2GiB", "--kv-disk-path", disk)
            work = functools.partial(_chat_load, args=args, label="chat kvwise")
            runs["kvwise"].append(
                serve_process(cmd, f"http://127.0.0.1:{port}", work, name="kvwise serve")
            )
        if binary:
            import torch

            server = llamacpp.LlamaServer(
                binary, gguf, torch.get_num_threads(), args.conversations, slot_ctx
            )
            with server:
                try:
                    result = asyncio.run(_chat_load(server.url, args, "chat llama.cpp"))
                    runs["llama.cpp"].append(result)
                except Exception as exc:  # noqa: BLE001 - report the peer's failure, keep ours
                    print(
                        f"llama-server failed ({type(exc).__name__}: {exc}); its log ends:\n"
                        f"{server.log_tail()}"
                    )
                    if server.proc is not None and server.proc.poll() is not None:
                        print(f"llama-server exited with {server.proc.returncode}")
        if vllm:
            runs["vllm"].append(
                vllm_peer.serve(
                    vllm,
                    args.vllm_model,
                    2 << 30,
                    slot_ctx,
                    lambda u: _chat_load(u, args, "chat vllm"),
                )
            )
    result = _report(runs, args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _report(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """Each server's median TTFT per turn (over its rounds' conversations), printed as a
    table with the prompt size each turn reached."""
    result = {"args": vars(args) | {"func": None}, "runs": runs, "median_ttft_s": {}}
    for name, server_runs in runs.items():
        if not server_runs:
            continue
        result["median_ttft_s"][name] = [
            statistics.median(v for run in server_runs for v in run["ttft_s"][t])
            for t in range(args.turns)
        ]
    sizes = [
        max((n or 0) for run in runs["kvwise"] for n in run["prompt_tokens"][t])
        for t in range(args.turns)
    ]
    turns = range(1, args.turns + 1)
    print("| median TTFT | " + " | ".join(f"turn {t}" for t in turns) + " |")
    print("|---|" + "---:|" * args.turns)
    print("| prompt tokens (kvwise, largest) | " + " | ".join(f"{n:,}" for n in sizes) + " |")
    for name, ttfts in result["median_ttft_s"].items():
        print(f"| {name} | " + " | ".join(f"{v:.2f} s" for v in ttfts) + " |")
    return result
