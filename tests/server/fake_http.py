"""Shared by the HTTP tests on fake engines: request bodies, SSE parsing, /metrics scraping,
a served fake engine and stepping a gated runner."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwise.server import create_app
from kvwise.types import SamplingParams
from tests.fakes import ControlledRunner, run_all

from .conftest import LiveServer

MODEL = "fake"
P = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [f"prompt number {i}: " + "abcdefgh" * (2 + i % 3) for i in range(6)]
LONG = "The same long prefix every time, " * 3  # 99 bytes: 24 full blocks of 4
CHAT = [{"role": "user", "content": "Tell me about blocks. " * 3}]


# ---- helpers -------------------------------------------------------------------------------


def run_sync(engine, prompts, params=P) -> list:
    """The synchronous engine's final outputs, in prompt order."""
    return run_all(engine, prompts, params)


def completion(prompt, max_tokens: int = 12, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def chat(messages, max_tokens: int = 12, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def events(response: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent-event response (JSON, or the string [DONE])."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """/metrics as ``{(sample name, sorted labels): value}``."""
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fresh_stats(server: LiveServer):
    """The engine's stats now (``AsyncEngine.stats()`` may predate the last step's end).
    Runs on the engine thread: never while a step waits at a shut gate."""
    return server.engine.call_sync(lambda e: e.stats())


@contextmanager
def serve(engine, **app_kwargs) -> Iterator[tuple[LiveServer, httpx.Client]]:
    """The app over ``engine`` on a loopback port, and a client for it. A ``ControlledRunner``
    gate is opened before the server stops (a failed test must not leave the engine held)."""
    app = create_app(engine, model_name=MODEL, **app_kwargs)
    with LiveServer(app) as server, httpx.Client(base_url=server.base_url, timeout=10) as client:
        try:
            yield server, client
        finally:
            runner = server.engine.engine.runner
            if isinstance(runner, ControlledRunner):
                runner.open_gate()


def step_until(runner: ControlledRunner, future: concurrent.futures.Future, max_steps: int = 40):
    """Let the held engine through one step at a time until ``future`` (an HTTP call whose
    command waits for the end of a step) is done; the gate is shut again afterwards."""
    for _ in range(max_steps):
        try:
            return future.result(timeout=0.02)
        except concurrent.futures.TimeoutError:
            runner.allow_steps(1)
            assert runner.wait_until_blocked(), "the engine ran out of work"
    raise AssertionError(f"not done after {max_steps} steps")
