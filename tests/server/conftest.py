"""Server fixtures: real servers on free loopback ports, in a background thread.

Two engines: the default model (SmolLM2, loaded once per session) for the official-client tests,
and a tiny random Llama with the default model's tokenizer (2 layers, hidden 32: a step takes
about a millisecond) for protocol, backpressure, disconnect and fuzz tests.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import uvicorn

from kvwise.config import EngineConfig
from kvwise.engine.async_engine import AsyncEngine
from kvwise.engine.builder import build_model_parts
from kvwise.engine.llm_engine import LLMEngine
from kvwise.engine.tokenizer import Tokenizer
from kvwise.models.arch import ModelArchConfig
from kvwise.models.decoder import CausalLM
from kvwise.models.default import default_model_path
from kvwise.models.loader import LoadedModel
from kvwise.server import create_app

KEYS = {"key-alice": "alice", "key-bob": "bob", "key-carol": "carol"}  # carol: one test each
TINY_NAME = "tiny"
TINY_CONTEXT = 256


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app, graceful_s: float = 2.0, server_cls=None) -> None:
        """``server_cls``: e.g. ``DrainingServer`` (None: plain ``uvicorn.Server``)."""
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s)
        if server_cls is None:
            self.server = uvicorn.Server(config)
        else:
            self.server = server_cls(config, app.state.engine)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.engine


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_until_serving(proc, base: str, timeout: float = 120.0) -> None:
    """Wait for a ``kvwise serve`` subprocess to answer ``/health`` (failing with its output
    if it exits first)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvwise serve did not come up"
        time.sleep(0.2)


def stop_serving(proc, timeout: float = 60.0) -> str:
    """SIGTERM a ``kvwise serve`` subprocess (killing it if it hangs); return its output."""
    import signal

    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out.decode()


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    """A 2-layer random Llama over the default model's tokenizer (and chat template)."""
    source = default_model_path()
    tokenizer = Tokenizer.from_path(source)
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=False,
    )
    generator = torch.Generator().manual_seed(0)
    model = CausalLM(arch, torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return LoadedModel(model=model, arch=arch, source=source, fingerprint="tiny-random-0")


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_loaded):
    def make(*, wrap_runner=None, **kwargs) -> LLMEngine:
        """A tiny-model engine; ``wrap_runner`` (e.g. ``tests.fakes.ControlledRunner``) wraps
        its model runner, and the engine is assembled around the wrapper."""
        kwargs.setdefault("kv_cache_memory", "4MiB")
        kwargs.setdefault("kv_host_memory", "off")
        kwargs.setdefault("kv_disk_path", "off")
        config = EngineConfig.from_kwargs(**kwargs)
        parts = build_model_parts(config, progress=False, loaded=tiny_loaded)
        return parts.assemble(config, wrap_runner(parts.runner) if wrap_runner else None)

    return make


@pytest.fixture(scope="module")
def tiny_server(make_tiny_engine):
    """A tiny-model server with the two API keys of KEYS."""
    app = create_app(make_tiny_engine(), api_keys=KEYS, model_name=TINY_NAME)
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="session")
def real_server(make_engine):
    """The default model behind API keys (SmolLM2, context capped at 2,048 tokens)."""
    app = create_app(
        make_engine(max_model_len=2048, kv_cache_memory="128MiB"),
        api_keys=KEYS,
        model_name="SmolLM2-135M-Instruct",
    )
    with LiveServer(app) as server:
        yield server
