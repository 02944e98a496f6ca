"""Helpers shared by benchmarks: timing, medians, bandwidth, transformers as the peer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import torch

from kvwise.types import RequestOptions


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered`` (the value at index ``q * n``; NaN if none)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def sse_chunks(resp) -> AsyncIterator[dict]:
    """The JSON chunks of a streamed OpenAI answer (an httpx streaming response)."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def kvwise_serve_cmd(gguf: str, port: int, *flags: str) -> list[str]:
    """The command line of ``kvwise serve`` on ``gguf`` at ``port`` in this Python, with
    ``flags``."""
    return [
        sys.executable,
        "-m",
        "kvwise.cli",
        "serve",
        "--model",
        gguf,
        "--port",
        str(port),
        *flags,
    ]


def serve_process(
    cmd: list[str], url: str, work, timeout: float = 300, name: str | None = None
) -> dict:
    """Start a server process, wait (``timeout`` s at most) until its /health answers (no API
    key needed; the wait is a progress phase on stderr, the server called ``name``, by
    default the command's program), return ``asyncio.run(work(url))``, stop it."""
    from kvwise.bench.progress import phase

    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        with phase(f"starting {name or os.path.basename(cmd[0])} on {url}"):
            wait_ready(url, proc, timeout=timeout)
        return asyncio.run(work(url))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def measure_read_bandwidth(num_bytes: int = 1 << 30, reps: int = 5, best: bool = False) -> float:
    """Bytes/s of streaming reads (a sum over a buffer much larger than the caches): the
    median run, or with ``best`` the fastest (a peak, as STREAM reports it)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return num_bytes / (min(times) if best else median(times))


def wait_ready(url: str, proc=None, timeout: float = 120, path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200; fail if ``proc`` (a server process) exits
    first or ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout} s")


def load_hf_reference(path, dtype: torch.dtype = torch.float32):
    """transformers' own model over the same weights (GGUF or HF dir), greedy, no EOS stop."""
    from pathlib import Path

    import transformers

    path = Path(path)
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


class TimingStreamer:
    """A transformers streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._first = True

    def put(self, value) -> None:
        if self._first:  # the prompt
            self._first = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_to_completion(engine, prompts: list, params, **options):
    """Submit every prompt at once, step until all finish; return (outputs in order, wall s).

    ``params`` is one SamplingParams for all prompts or a list of them; ``options`` are
    ``RequestOptions`` fields (``cache_salt=...``).
    """
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    request_options = RequestOptions(**options)
    ids = [
        engine.add_request(p, sp, request_options)
        for p, sp in zip(prompts, params_list, strict=True)
    ]
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids], time.perf_counter() - start
