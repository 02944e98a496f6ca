"""Issue 44's first hour, on the real command and the default model: a port in use and a KV pool
that cannot fit end ``kvwise serve`` with one line naming the flag, exit status 2, before the
model loads; two servers on two ports and a ``kvwise generate`` beside them all start and
answer with their default disk tiers (one directory each); ``GET /version``, open as /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvwise import __version__
from kvwise.machine import available_memory_bytes
from kvwise.models.default import DEFAULT_MODEL_NAME
from kvwise.version import torch_version

from .conftest import LiveServer, stop_serving, wait_until_serving

KVWISE = [sys.executable, "-m", "kvwise.cli"]
LOADING = ("weights:", "Loading ", "KV pool: ")  # what the log says once the model loads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kvwise(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([*KVWISE, *args], capture_output=True, text=True, timeout=120, env=env)
    return result, time.monotonic() - start


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvwise: error: "), result.stderr
    assert not any(word in result.stderr for word in LOADING), result.stderr
    return lines[0].removeprefix("kvwise: error: ")


def test_a_port_in_use_is_said_before_the_model_loads(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, seconds = run_kvwise("serve", "--port", str(port), env=env)
    message = one_error_line(result)
    assert message.startswith(f"--port: 127.0.0.1:{port} is already in use"), message
    assert seconds < 8  # the checks, with no torch import and no model load
    assert not (tmp_path / "kvwise").exists()  # nothing written


def test_a_kv_pool_that_cannot_fit_is_one_line_naming_the_flag(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    gib = 2 * available_memory_bytes() >> 30
    for command in (["serve", "--port", str(_free_port())], ["generate", "Hi"]):
        result, seconds = run_kvwise(*command, "--kv-cache-memory", f"{gib}GiB", env=env)
        message = one_error_line(result)
        assert message.startswith(f"--kv-cache-memory: {gib}.0 GiB does not fit: "), message
        assert "GiB of RAM available, at most ~" in message and "for the KV pool" in message
        assert seconds < 15


def test_the_python_api_refuses_a_pool_that_cannot_fit_before_loading():
    from kvwise import LLM

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^kv_cache_memory: .* does not fit: "):
        LLM(kv_cache_memory=2 * available_memory_bytes(), kv_disk_path="off")
    assert time.monotonic() - start < 1  # no model loaded


def _chat(base: str) -> dict:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_two_servers_and_a_generate_beside_them_all_answer_with_their_default_disk_tiers(
    tmp_path,
):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    ports = [_free_port(), _free_port()]
    procs = [
        subprocess.Popen(
            [*KVWISE, "serve", "--port", str(port), "--max-num-seqs", "4"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for port in ports
    ]
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_until_serving(proc, f"http://127.0.0.1:{port}", timeout=300)
        for port in ports:
            assert _chat(f"http://127.0.0.1:{port}")["usage"]["completion_tokens"] > 0
        version = httpx.get(f"http://127.0.0.1:{ports[0]}/version").json()
        assert version == {
            "version": __version__,
            "torch": torch_version(),
            "model": DEFAULT_MODEL_NAME,
        }
        result, _ = run_kvwise("generate", "Hi", "--max-tokens", "3", env=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip(), result.stderr
        assert f"KV disk tier: {tmp_path / 'kvwise' / 'kv-local'}," in result.stderr
    finally:
        logs = [stop_serving(proc, timeout=60) for proc in procs]
    for port, log in zip(ports, logs, strict=True):
        where = tmp_path / "kvwise" / f"kv-{port}"
        assert f"KV disk tier: {where}, " in log and f"this server's own, port {port}" in log
        assert "KV pool: " in log and "--max-num-seqs 4 x 1024 tokens" in log
    found = sorted(p.name for p in (tmp_path / "kvwise").iterdir())
    assert found == sorted([f"kv-{ports[0]}", f"kv-{ports[1]}", "kv-local"])


def test_version_is_open_and_names_the_model():
    from kvwise.server import create_app
    from tests.fakes import fake_engine

    app = create_app(fake_engine(), api_keys={"sk-a": "alice"}, model_name="tiny")
    with LiveServer(app) as server:
        r = httpx.get(server.base_url + "/version")  # no key: open, as /health
        assert r.status_code == 200
        assert r.json() == {"version": __version__, "torch": torch_version(), "model": "tiny"}
        assert httpx.get(server.base_url + "/v1/models").status_code == 401  # keys are on
